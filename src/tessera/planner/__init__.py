"""The planner: predict the speed and memory of every parallel layout, pick the best, explain.

See docs/planner.md. Modules: ``hardware`` (devices and links), ``models`` (model shapes),
``cost`` (the formulas), ``pipeline`` (the planner's use of the pipeline simulator), ``search``
(enumerate, drop over-memory layouts, rank), ``report`` (tables, explanation, plot),
``calibrate`` (measure this machine), ``cli`` (``tessera plan``).
"""
