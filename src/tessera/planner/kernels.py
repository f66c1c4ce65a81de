"""Kernels per step: how many kernels one transformer block launches in its forward and its
backward, eager and compiled, how many a rank's step launches outside them (zero_grad, the
global norm, clipping, AdamW), and the floor their launches put under a stretch of work.

Eager (``Workload.kernels`` 'tessera'): tessera's reference block (``tessera.model.Block``) op
by op, each dispatched ATen op that computes (views and reshapes excluded) one kernel, counted
per part from the code (tests/test_planner_kernels.py checks the sum against a dispatch count):

==========================  =======  ========  ==============================================
part                        forward  backward  ops
==========================  =======  ========  ==============================================
RMSNorm                     6        14        pow, mean, + eps, rsqrt, two multiplies; back:
                                               the product rule through each
LayerNorm                   1        1         the fused native_layer_norm
RoPE (per rotated tensor)   7        10        4 multiplies, a subtract, an add, the stack;
                                               back: the products, a negation, the halves'
                                               slice_backward and their sum
weight GEMM (each)          1        2         x·Wᵀ; back dX and dW (+1 dB with a bias)
attention core              1        1         scaled_dot_product_attention
MLP activation              2 / 1    3 / 1     SwiGLU silu·mul / GELU
residual adds               2        0
gradient sums at forks      0        4 + M-2   q, k, v read one input (2 adds), the MLP's M-1
                                               input matrices (M-2), the two residual forks
bf16 casts                  2 each   2 each    each RMSNorm and RoPE call casts up to fp32 and
                                               back (tests/test_bf16_casts.py)
==========================  =======  ========  ==============================================

A mixture-of-experts block (``tessera.moe.MoEFeedForward`` in place of the SwiGLU MLP;
:func:`eager_moe_block`) is the dense block less its MLP's GEMMs, activation and fork, plus the
MoE layer's ops, counted the same way, for E_r = E/ep experts on the rank:

==========================  =======  ========  ==============================================
part                        forward  backward  ops
==========================  =======  ========  ==============================================
router                      5        6         GEMM, softmax, top-k, the gates' gather, the
                                               keep mask; back: the GEMM's 2, softmax, the
                                               gather's zeros and scatter_add, the layer
                                               input's fork (router and rows)
top-k > 1                   2        7         the gates renormalized (sum, divide); back:
                                               the division's 5, the sum, a fork
dispatch                    10       2         assignment → token index (arange, a copy),
                                               nonzero, the stable sort and its 3 gathers,
                                               bincount, the rows' token index and gather;
                                               back: the gather's zeros and index_put
each of the E_r experts     5        10        3 GEMMs, silu, product; back: the GEMMs' 6,
                                               silu's and the product's 3, the input's fork
experts (once)              1        4         the outputs' cat; back: the split's cat, and
                                               the 3 stacks of the unbound weights' slices
combine                     4        6         the gate's gather, zeros, the gated product,
                                               index_add; back: index_select, the product's
                                               2 and sum, the gate gather's zeros, index_put
auxiliary losses            16       0         always computed: one_hot (min/max, 2 host
                                               reads, zeros, scatter), the shares, mean
                                               probabilities and their product, z-loss
attached to the loss        3        16        a load-balancing or z-loss coefficient > 0:
                                               the weighted sum; back: both losses' graphs
load statistics             9        0         training: bincount, a cast, the counters'
                                               2 adds, the dropped count (not, sum) and 3
                                               host reads (it and the two losses)
capacity (C > 0)            11       0         one_hot (5), its transposed copy, cumsum,
                                               the positions (mul, sum), the mask and its
                                               copy
router bias                 1        0         the balancing bias's add (selects only)
shared expert               5 + 1    10 + 1    the dense block's SwiGLU MLP and the add;
                                               back: the MLP's and the input's fork
bf16 casts                  3        3         the input and router weight up, gates down
expert parallel (ep > 1)    8 + 4E   3         the counts' sums, the arrival offsets
                                               (cumsum, subtract), per expert and source rank
                                               two host reads, an add and an arange; the
                                               index's cat, the arrivals' gather, the sizes'
                                               sum, index_copy back; back: index_select, the
                                               gather's zeros and index_put
==========================  =======  ========  ==============================================

The experts' loop runs every expert whatever its rows (an expert with none dispatches its ops
on empty tensors), so the count does not depend on the routing; the planner assumes what a
realistic batch gives on a GPU, every expert receiving tokens (an empty GEMM may launch
nothing there). Nor does it grow with k: the k·T assignments travel in the same ops. Not
counted: the all-to-alls (priced as communication, ``planner.moe``); allocations
(``new_empty``, ``empty_like``); with ``parallel.ep_alltoall`` 'pairwise', each exchange's
copy of its own block (3 forward, 2 backward); on a GPU, the device-to-host copies a CPU run
does not dispatch (``counts.tolist()``, the statistics' ``.cpu()``; under ep the other split
sizes' and the index's copy to the device). A replay under full recomputation skips the
statistics' 9 but is priced as the forward. The host reads (``_local_scalar_dense``: 5, 7
with capacity, 2·E more under ep) each synchronize the host with the device, which the floor
(asynchronous launches) does not model.

Compiled ('compiled', and 'fused' for the fused kernels of Megatron-LM and Llama 3's
training): the GEMMs and the attention kernel stay (extern kernels), and torch.compile's
inductor fuses each run of memory-bound work between two of them into one kernel, which
reads its inputs once and writes its outputs once (2 passes over the bytes it touches:
``Hardware.compiled_elementwise_passes``). A block has five such runs forward: the attention
norm, the RoPE of q and k, the residual add with the MLP norm, the MLP activation, the last
residual add; backward the same five and one reduction per norm weight. A compiled MoE block
is counted as a dense one (:func:`block_kernels`), though tessera's compile leaves
``MoEFeedForward`` eager (a graph break, docs/compile.md): its count there is a floor.

Per step, outside the blocks (:func:`step_kernels`, checked the same way against tessera's
``Executor.clip_grad_norm_`` and its optimizer's ``zero_grad`` and ``step``, with AdamW as it
runs on a GPU): the gradients zeroed, their global norm and the clipping, and the AdamW update,
on the tensors the optimizer sees on a rank. Where ZeRO's flat units hold the model state (any
ZeRO stage, and bf16 at stage 0: ``parallelize``'s precision policy) those are the U units,
stepped by ``ShardedAdamW`` with torch's fused AdamW kernel on a GPU, once per group of units
of at most 2²⁶ owned elements (``tessera.parallel.update_batches``); otherwise the N parameter
tensors, stepped by ``torch.optim.AdamW`` with ``fused=True`` on a GPU (both by
``tessera.optim.uses_fused_adamw``):

=================  ==================================  =========================================
part               flat units                          per-parameter (fused AdamW)
=================  ==================================  =========================================
zero_grad          1: ``_foreach_zero_`` over every    0 (gradients set to None)
                   unit's buffer (buffers reused)
global norm        8: zeros, one ``_foreach_norm``,    10: the same and the expert sum's zeros
                   stack, pow, sum, add_, sqrt, the    and add
                   host's read of the norm
clipping           1: ``_foreach_mul_`` over the       1: ``_foreach_mul_`` over the gradients
                   units' buffers
AdamW              per group of units, 2: the steps'   2 per param group (decayed matrices,
                   foreach add and ``_fused_adamw_``,  undecayed gains): the steps' foreach add
                   + one ``_foreach_mul_`` over its    and ``_fused_adamw_``
                   decayed ranges
bf16               U + 1: each unit's gradient cast    (bf16 always runs on flat units)
                   up, one ``_foreach_copy_`` of the
                   masters into the parameters
=================  ==================================  =========================================

On a CPU ``ShardedAdamW`` runs AdamW's arithmetic as 7 multi-tensor ops per group instead
(lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_); CPU time is priced per tensor, not by
these counts (below).

The norm's read of the result synchronizes the host with the device, so the step's update
starts from an idle device and a host issuing its kernels one by one: an update of small
tensors is launch-bound. A multi-tensor op (``torch._foreach_*``, ``_foreach_norm``,
``_fused_adamw_``) counts as one: it is one dispatched op (what the test counts), and on a GPU
one launch per list as modelled here, while CUDA's multi-tensor apply actually launches once per
few dozen tensors or ~21M elements (320 chunks of 65536). The count is thus a floor for large
lists, where each launch carries enough bytes that the update's traffic, not its launches,
bounds the time. On a CPU a multi-tensor op runs a loop over its tensors, one per-tensor kernel
each inside the one dispatched op; CPU time is priced per tensor (``op_overhead_us``), not by
these launches. The collectives (ZeRO-1/2's all-gather after the step, the norm's
all-reduce) are priced as communication. The data-parallel wrappers' kernels inside the
backward (:func:`backward_hook_kernels`: accumulation into flat buffers, ZeRO's per-unit
division or flattening) join the launch floor of the backward that runs them
(``compute.compute_chunks``), DataParallel's copies of each fresh gradient into its bucket
(``ddp``) among them. The parameter server's per-tensor copies, outside the backward
(:func:`parameter_server_kernels`: the push packed, the pull unpacked, the server's sum and
reply), are priced with its exchange after the backward (``cost._parameter_server_time``).

Launches: an eager step's host issues each kernel (the Python call, autograd's graph, the
dispatcher, the launch) while an asynchronous device runs the kernels queued before it, so a
stretch of k kernels takes at least k · ``Hardware.launch_us`` whatever its device time
(:func:`launch_floor`). On a CPU the kernels run on the host: their fixed cost is
``Hardware.op_overhead_us``, added to the compute instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tessera.planner.models import ModelSpec

NORM = {"rmsnorm": (6, 14), "layernorm": (1, 1)}
ROPE = (7, 10)
ATTENTION = (1, 1)
ACTIVATION = {True: (2, 3), False: (1, 1)}
"""Gated (SwiGLU) or not (GELU)."""
CASTS_PER_CALL = 2
"""bf16: an fp32 up-cast and a down-cast per RMSNorm or RoPE call, forward and backward."""
FUSED_RUNS_FORWARD = 5
"""Memory-bound runs between extern kernels in a compiled block's forward (module doc)."""


@dataclass(frozen=True)
class Kernels:
    """Kernels launched by one forward and one backward."""

    forward: int
    backward: int

    def __add__(self, other: Kernels) -> Kernels:
        return Kernels(self.forward + other.forward, self.backward + other.backward)


def _gemms(spec: ModelSpec) -> int:
    """Weight GEMMs of one block: Q, K, V, O and the MLP's matrices."""
    return 4 + spec.mlp_matrices


def _rotated(spec: ModelSpec) -> int:
    """Tensors RoPE rotates per block (q and k), none with learned positions."""
    return 0 if spec.learned_positions else 2


def eager_block(spec: ModelSpec, precision: str = "bf16") -> Kernels:
    """Kernels of one eager block, forward and backward (module doc's table)."""
    g, rope = _gemms(spec), _rotated(spec)
    nf, nb = NORM[spec.norm]
    af, ab = ACTIVATION[spec.mlp_matrices == 3]
    forward = 2 * nf + g + rope * ROPE[0] + ATTENTION[0] + af + 2
    forks = 2 + (spec.mlp_matrices - 2) + 2
    backward = 2 * nb + 2 * g + (g if spec.bias else 0) + rope * ROPE[1] + ATTENTION[1] + ab \
        + forks
    if precision != "fp32" and spec.norm == "rmsnorm":
        casts = CASTS_PER_CALL * (2 + rope)
        forward, backward = forward + casts, backward + casts
    return Kernels(forward, backward)


MOE_ROUTER = (5, 6)
MOE_TOP_K = (2, 7)
"""The gates' renormalization where k > 1."""
MOE_DISPATCH = (10, 2)
MOE_EXPERT = (5, 10)
"""Per expert held on the rank."""
MOE_EXPERTS_ONCE = (1, 1 + 3)
"""The outputs' cat and the split's; the three weights' slices stacked into their gradients."""
MOE_COMBINE = (4, 6)
MOE_AUX = (16, 0)
"""The auxiliary losses, computed whatever their coefficients."""
MOE_AUX_ATTACHED = (3, 16)
"""A load-balancing or z-loss coefficient > 0: the losses' sum, and their backward."""
MOE_STATS = (9, 0)
MOE_CAPACITY = (11, 0)
MOE_ROUTER_BIAS = (1, 0)
MOE_SHARED_ADD = (1, 1)
"""The shared expert's output added (and the input's fork), beside its MLP's kernels."""
MOE_CASTS = (3, 3)
"""bf16: the input and the router weight cast up to fp32, the gates down."""
MOE_EP_ONCE = (8, 3)
MOE_EP_PER_EXPERT = 4
"""ep > 1, per expert of the whole layer (each held expert from each source rank)."""


def _mlp(spec: ModelSpec) -> Kernels:
    """The dense MLP's kernels in :func:`eager_block`: its GEMMs, activation, input's fork."""
    af, ab = ACTIVATION[spec.mlp_matrices == 3]
    m = spec.mlp_matrices
    return Kernels(m + af, 2 * m + (m if spec.bias else 0) + ab + m - 2)


def eager_moe_block(spec: ModelSpec, precision: str = "bf16") -> Kernels:
    """Kernels of one eager mixture-of-experts block (``spec.moe``), forward and backward: the
    dense block's without its MLP, plus the MoE layer's (module doc's second table), with
    ``spec.moe.experts / spec.moe.ep`` experts on the rank, each receiving tokens."""
    moe = spec.moe
    if moe is None:
        raise ValueError(f"{spec.name} has no MoE blocks")
    held = moe.experts // moe.ep
    parts = [MOE_ROUTER, MOE_DISPATCH, (held * MOE_EXPERT[0], held * MOE_EXPERT[1]),
             MOE_EXPERTS_ONCE, MOE_COMBINE, MOE_AUX, MOE_STATS]
    parts += [MOE_TOP_K] if moe.top_k > 1 else []
    parts += [MOE_AUX_ATTACHED] if moe.aux_losses else []
    parts += [MOE_CAPACITY] if moe.capacity else []
    parts += [MOE_ROUTER_BIAS] if moe.router_bias else []
    parts += [MOE_CASTS] if precision != "fp32" else []
    if moe.ep > 1:
        parts += [MOE_EP_ONCE, (MOE_EP_PER_EXPERT * moe.experts, 0)]
    layer = sum((Kernels(*p) for p in parts), Kernels(0, 0))
    if moe.shared:
        layer += _mlp(spec) + Kernels(*MOE_SHARED_ADD)
    dense, mlp = eager_block(spec, precision), _mlp(spec)
    return Kernels(dense.forward - mlp.forward, dense.backward - mlp.backward) + layer


def compiled_block(spec: ModelSpec) -> Kernels:
    """Kernels of one compiled (or hand-fused) block: its GEMMs and attention, and one kernel
    per fused memory-bound run (module doc)."""
    g = _gemms(spec)
    runs = FUSED_RUNS_FORWARD - (0 if _rotated(spec) else 1)
    norm_weights = 2 * (2 if spec.norm == "layernorm" else 1)
    return Kernels(g + ATTENTION[0] + runs,
                   2 * g + (g if spec.bias else 0) + ATTENTION[1] + runs + norm_weights)


def head(spec: ModelSpec, precision: str, compiled: bool) -> Kernels:
    """The last chunk's final norm, LM head GEMM and loss (log-softmax and NLL on fp32
    logits: a cast in bf16); compiled: forward the norm's run, the GEMM, the loss's run;
    backward the loss's run, the GEMM's two, the norm's run and its weight's reduction."""
    if compiled:
        return Kernels(1 + 1 + 1, 1 + 2 + 1 + 1)
    nf, nb = NORM[spec.norm]
    casts = 2 * CASTS_PER_CALL if precision != "fp32" else 0
    return Kernels(nf + 1 + 2 + casts, nb + 2 + 2 + casts)


EMBEDDING = Kernels(1, 1)
"""The lookup; back: embedding_dense_backward."""


def block_kernels(spec: ModelSpec, precision: str, kernels: str, moe: bool = False) -> Kernels:
    """One block's kernels under ``Workload.kernels``: 'tessera' eager, else compiled; `moe`:
    one of the model's MoE blocks (``spec.moe``), counted as such when eager (compiled: as a
    dense block, module doc)."""
    if kernels != "tessera":
        return compiled_block(spec)
    return eager_moe_block(spec, precision) if moe else eager_block(spec, precision)


def launch_floor(launch_us: float, count: int) -> float:
    """Seconds the host needs to issue `count` kernels (0 where launches are free)."""
    return count * launch_us * 1e-6


FLAT_STEP_OPS = 1 + 1
"""Per rank and step on flat units: one multi-tensor op zeroing every unit's gradient buffer,
one clipping them (``tessera.parallel.zero``)."""
FLAT_ADAMW_OPS = 2
"""ShardedAdamW's ops per group of units (``tessera.parallel.update_batches``) on a GPU: a
foreach add of the units' step counts and one ``_fused_adamw_`` (module doc)."""
FLAT_DECAY_OPS = 1
"""ShardedAdamW's weight decay: one multi-tensor mul_ per group holding decayed ranges."""
PARAMETER_OPS = 1
"""Per rank and step (fused AdamW): one multi-tensor op clipping every parameter's gradient."""
NORM_OPS = {True: 8, False: 10}
"""The global norm's kernels on flat units (True) and on parameters (False) (module doc)."""
FUSED_ADAMW_OPS = 2 * 2
"""Two param groups, each a foreach add of its step counts and one ``_fused_adamw_``."""
BF16_UNIT_CASTS = 1
"""bf16, per unit: its gradient cast up to fp32 for the update."""
BF16_PUBLISH_OPS = 1
"""bf16, per rank: one multi-tensor copy casting every unit's master into the parameters."""


def step_kernels(tensors: int, *, flat: bool, precision: str, groups: int = 1,
                 decayed_groups: int = 0) -> int:
    """Kernels of one rank's step outside the forward and backward: zeroing the gradients, the
    global norm, clipping and AdamW (module doc's second table), a multi-tensor op counted once.
    `tensors`: the flat units (`flat`: in bf16 each casts its gradient up) or the parameter
    tensors the rank's optimizer steps (no per-tensor op: their clipping is one multi-tensor op);
    `groups`: the flat units' update groups (``tessera.parallel.update_batches``), of which
    `decayed_groups` hold weight-decayed ranges (one multi-tensor mul_ decays each)."""
    if not flat:
        return PARAMETER_OPS + NORM_OPS[False] + FUSED_ADAMW_OPS
    casts = tensors * BF16_UNIT_CASTS + BF16_PUBLISH_OPS if precision == "bf16" else 0
    return (FLAT_STEP_OPS + casts + groups * FLAT_ADAMW_OPS + decayed_groups * FLAT_DECAY_OPS
            + NORM_OPS[True])


def backward_hook_kernels(units: list[tuple[int, int]], micro_batches: int, *, flat: bool,
                          stage: int, dp: int, ddp: bool = False) -> int:
    """Kernels a rank's data-parallel wrapper adds to one step's backwards, outside the blocks,
    over its ZeRO `units` ((elements, parameter tensors) each, ``engine.rank_units``); the
    collectives (all-reduce, reduce-scatter) are priced as communication, not counted.
    Flat units at stages 0-1: each parameter's gradient accumulated into its view of the unit's
    buffer every micro-batch (autograd's in-place add), and each unit's division by its
    divisor once a step. Stages 2-3: per unit and micro-batch, the gradients flattened (one cat,
    plus the padding's zeros where dp does not divide the unit), then the shard divided (first
    micro-batch) or the reduced part added in (the others). Per parameter (no flat units):
    every micro-batch after the first accumulates each gradient in place, and under `ddp`
    (DataParallel at dp > 1) the first copies each fresh gradient into its bucket slot. Not
    counted: DataParallel's two kernels per bucket (the used flags' copy, the division after the
    all-reduce) and, under ``train.noise_scale`` at dp > 1, the local gradients' sums of
    squares before each reduction."""
    n_units, tensors = len(units), sum(k for _, k in units)
    if not flat:
        return (micro_batches - 1 + (1 if ddp else 0)) * tensors
    if stage < 2:
        return micro_batches * tensors + n_units
    padded = sum(1 for n, _ in units if n % dp)
    return micro_batches * (2 * n_units + padded)


PS_PUSH_TENSOR_OPS = 2
"""Per parameter tensor in a push (``ParameterServer._pack_push``): its gradient copied into its
slot (or the slot zeroed), its used flag written."""
PS_PUSH_OPS = 2
"""Per push: the loss and the version written."""
PS_PULL_TENSOR_OPS = 1
"""Per parameter tensor in a pull received (``_unpack_pull``): the parameter copied from its
slot."""
PS_REPLY_OPS = 1 + 3
"""Per pull packed (``_pack_pull``): one cat of the parameters (``.float()`` of an fp32 tensor
is the tensor itself), the loss, the norm and the version written."""
PS_SUM_OPS = 5
"""The synchronous server's sum (``gather_gradients``), besides one add per worker's push: its
own push cloned, the gradient divided by dp (the in-place slice's setitem copies it back),
copied into the flat gradient (``_unpack_gradients``), the loss read."""
PS_SERVE_OPS = 1 + PS_REPLY_OPS
"""The asynchronous server per push served (``serve``): the gradient copied into the flat
gradient, the reply packed (its clipping and update are an optimizer step)."""
PS_WORKER_NORM_OPS = 7
"""The asynchronous worker's norm of its own gradient (``ServerSync._local_grad_norm``): zeros,
one ``_foreach_norm``, stack, pow, sum, add_, the host's read (the root taken on the host)."""


def _ps_push(tensors: int) -> int:
    """Kernels of one push packed over `tensors` parameter tensors."""
    return PS_PUSH_TENSOR_OPS * tensors + PS_PUSH_OPS


def _ps_sum(dp: int) -> int:
    """The synchronous server's kernels after its own push is packed: the dp − 1 pushes added
    in, the sum's PS_SUM_OPS, one reply packed for all."""
    return (dp - 1) + PS_SUM_OPS + PS_REPLY_OPS


def parameter_server_kernels(tensors: int, dp: int, *, server: bool,
                             asynchronous: bool) -> int:
    """Kernels one rank of a parameter server's group of `dp` dispatches per step in its
    exchange (``ServerSync.exchange`` and the server's reply after its optimizer step), over the
    `tensors` parameter tensors every rank holds; the messages are communication, and the
    server's norm, clipping and update are its optimizer step (:func:`step_kernels`). Worker:
    its push packed and the pull unpacked, per tensor PS_PUSH_TENSOR_OPS + PS_PULL_TENSOR_OPS,
    and asynchronous its own gradient's norm first. Synchronous server: its own gradient packed
    as a push, then :func:`_ps_sum`. Asynchronous server: PS_SERVE_OPS per push served. Not
    counted: the host's reads of a message's flags and scalars (``tolist``), which dispatch
    nothing on a CPU and are each a device-to-host copy on a GPU."""
    if server:
        return (dp - 1) * PS_SERVE_OPS if asynchronous else _ps_push(tensors) + _ps_sum(dp)
    return (_ps_push(tensors) + PS_PULL_TENSOR_OPS * tensors
            + (PS_WORKER_NORM_OPS if asynchronous else 0))


def parameter_server_step_kernels(tensors: int, dp: int) -> int:
    """The kernels of a synchronous parameter server's :func:`parameter_server_kernels` that a
    step waits for, one after another after the backward: a worker's push packed (the server
    packs its own at the same time), the server's sum and reply, the worker's pull unpacked.
    (Asynchronous, the server serves the pushes in turn while the workers pack and unpack their
    own: ``cost._parameter_server_time`` takes the longer of the two.)"""
    return _ps_push(tensors) + _ps_sum(dp) + PS_PULL_TENSOR_OPS * tensors


class Hooks(NamedTuple):
    """What sets a rank's data-parallel backward kernels (:func:`backward_hook_kernels`)."""

    flat: bool
    stage: int
    dp: int
    micro_batches: int
    ddp: bool = False


def hook_kernels_per_microbatch(units: list[tuple[int, int]], hooks: Hooks) -> float:
    """:func:`backward_hook_kernels` of `units` over a step, per micro-batch (the step's total
    spread evenly: the pipeline sums a chunk's backward over its micro-batches)."""
    return backward_hook_kernels(units, hooks.micro_batches, flat=hooks.flat, stage=hooks.stage,
                                 dp=hooks.dp, ddp=hooks.ddp) / hooks.micro_batches
