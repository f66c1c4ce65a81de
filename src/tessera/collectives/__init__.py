"""Collective communication built only from torch.distributed point-to-point messages.

Why: to see (and measure) what an all-reduce costs, and to choose among algorithms with the
alpha-beta model of Thakur, Rabenseifner & Gropp 2005 ("Optimization of Collective
Communication Operations in MPICH") and Chan et al. 2007 ("Collective communication: theory,
practice, and experience").

- :mod:`~tessera.collectives.p2p`: the round primitive, :class:`CommStats`, the shard rule.
- :mod:`~tessera.collectives.algorithms`: all-reduce (naive, parallel, ring, Rabenseifner),
  reduce-scatter and all-gather (ring, recursive).
- :mod:`~tessera.collectives.rooted`: broadcast, reduce, scatter, gather (binomial trees) and
  all-to-all (pairwise, also with variable split sizes).
- :mod:`~tessera.collectives.cost_model`: predicted times, ``auto`` choice, measurement.

Every function takes its process group as an argument (None = the default group) and keeps no
state between calls; ``stats=`` accumulates the bytes and rounds of this rank.
"""

from tessera.collectives.algorithms import (
    ALL_GATHER_ALGORITHMS,
    ALL_REDUCE_ALGORITHMS,
    REDUCE_SCATTER_ALGORITHMS,
    all_gather,
    all_reduce,
    reduce_scatter,
)
from tessera.collectives.cost_model import (
    ALGORITHMS,
    AlphaBeta,
    choose_algorithm,
    default_model,
    fit_alpha_beta,
    measure_alpha_beta,
    predict_time,
)
from tessera.collectives.p2p import REDUCE_OPS, CommStats, shard_bounds
from tessera.collectives.rooted import (
    ALL_TO_ALL_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    GATHER_ALGORITHMS,
    REDUCE_ALGORITHMS,
    SCATTER_ALGORITHMS,
    all_to_all,
    all_to_all_v,
    broadcast,
    gather,
    reduce,
    scatter,
)

__all__ = [
    "ALGORITHMS",
    "ALL_GATHER_ALGORITHMS",
    "ALL_REDUCE_ALGORITHMS",
    "ALL_TO_ALL_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "GATHER_ALGORITHMS",
    "REDUCE_ALGORITHMS",
    "REDUCE_OPS",
    "REDUCE_SCATTER_ALGORITHMS",
    "SCATTER_ALGORITHMS",
    "AlphaBeta",
    "CommStats",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "choose_algorithm",
    "default_model",
    "fit_alpha_beta",
    "gather",
    "measure_alpha_beta",
    "predict_time",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shard_bounds",
]
