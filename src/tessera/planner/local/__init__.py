"""The planner's model of the local machine: CPU ranks measured by ``tessera plan calibrate``."""
