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

Compiled ('compiled', and 'fused' for the fused kernels of Megatron-LM and Llama 3's
training): the GEMMs and the attention kernel stay (extern kernels), and torch.compile's
inductor fuses each run of memory-bound work between two of them into one kernel, which
reads its inputs once and writes its outputs once (2 passes over the bytes it touches:
``Hardware.compiled_elementwise_passes``). A block has five such runs forward: the attention
norm, the RoPE of q and k, the residual add with the MLP norm, the MLP activation, the last
residual add; backward the same five and one reduction per norm weight.

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


def block_kernels(spec: ModelSpec, precision: str, kernels: str) -> Kernels:
    """One block's kernels under ``Workload.kernels``: 'tessera' eager, else compiled."""
    return eager_block(spec, precision) if kernels == "tessera" else compiled_block(spec)


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
