"""ZeRO's optimizer over flat shards, checkpoint gathering, and model-state memory accounting.

``ShardedAdamW`` steps each unit's fp32 master shard with exactly the arithmetic of
``torch.optim.AdamW`` (single-tensor path: decoupled weight decay, then the bias-corrected
moment update), so on the elements it owns a rank computes what a replicated AdamW would. Weight
decay applies to the ranges of the shard that hold matrices (as ``tessera.optim.adamw`` does).
Each op of the update runs once over a list of units' tensors (``torch._foreach_*``:
decay over every decayed range, lerp, mul, addcmul, sqrt, div, add, addcdiv), the units grouped
by at most 2²⁶ owned elements (``tessera.parallel.update_batches``, which bounds the update's
temporaries), so a GPU launches a handful of multi-tensor kernels per group; in bf16 each
unit's gradient is cast up to fp32 first. After the step the ``ZeroModel``s publish the new
weights (``zero.publish_unit_parameters``: one multi-tensor cast copy, and all-gathers at
stages 1-2).

Memory accounting follows the ZeRO paper (Rajbhandari et al. 2020, section 3 and figure 1): with
mixed precision a parameter costs 2 bytes (bf16 weight) + 2 (bf16 gradient) + K = 12 (fp32
master copy and Adam's m and v), so per rank

    stage 0: (2 + 2 + K) Psi    stage 1: 4 Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N    stage 3: (2 + 2 + K) Psi / N.

In plain fp32 the weight is its own master copy: 4 (weight) + 4 (gradient) + 8 (m and v), the
same 16 bytes per parameter split (P, G, K) = (4, 4, 8) instead of (2, 2, 12); the formulas
keep their shape with those numbers (stage 1: 8 Psi + 8 Psi / N, and so on).

Gathering: ``ShardedAdamW.full_state`` all-gathers the Adam moments by reference name (tests
compare them with torch's AdamW); ``gather_owned`` and ``unflatten`` serve
``ParallelModel.full_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tessera.collectives.algorithms import all_gather_single
from tessera.config import TrainConfig
from tessera.parallel.update_batches import update_batches
from tessera.parallel.zero import ZeroModel, publish_unit_parameters, zero_unit_grads
from tessera.parallel.zero_units import FlatUnit


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW on each ZeRO unit's fp32 master shard; one param group (the lr scheduler's).

    `zero`: one ``ZeroModel``, or several (the chunks a pipeline rank holds); their units are
    stepped in order and each model publishes its new parameters after the step."""

    def __init__(self, zero: ZeroModel | Sequence[ZeroModel], cfg: TrainConfig,
                 eps: float = 1e-8):
        defaults = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=eps,
                        weight_decay=cfg.weight_decay)
        self.zeros = [zero] if isinstance(zero, ZeroModel) else list(zero)
        self.units = [u for z in self.zeros for u in z.units]
        super().__init__([u.master for u in self.units], defaults)
        # Moments are allocated up front so memory accounting sees them from the start.
        for u in self.units:
            self.state[u.master] = {"step": 0, "exp_avg": torch.zeros_like(u.master),
                                    "exp_avg_sq": torch.zeros_like(u.master)}

    @property
    def zero(self) -> ZeroModel:
        """The wrapped model, when there is one (single-model use)."""
        return self.zeros[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the units' gradient buffers (they are reused, never set to None): one
        multi-tensor op over the units of every model (``zero.zero_unit_grads``)."""
        zero_unit_grads(self.zeros)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every unit: the units whose step counts agree (all of them, in
        training) are updated together by multi-tensor ops (``torch._foreach_*``), one op per
        list of tensors, in groups of at most ``UPDATE_BATCH_ELEMENTS`` owned elements
        (``tessera.parallel.update_batches``), then the models publish their parameters
        (``zero.publish_unit_parameters``: one multi-tensor copy of the masters)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_step: dict[int, list[FlatUnit]] = {}
            for u in self.units:
                state = self.state[u.master]
                state["step"] += 1
                by_step.setdefault(int(state["step"]), []).append(u)
            for step, units in by_step.items():
                for batch in update_batches([u.master.numel() for u in units]):
                    self._update([units[i] for i in batch], float(step), group)
        publish_unit_parameters(self.zeros)
        return loss

    def _update(self, units: list[FlatUnit], step: float, group: dict) -> None:
        """AdamW's update of `units`, all at step count `step`: per element the single-tensor
        AdamW's ops in the same order (on CPU bit for bit), each op applied to all the units'
        tensors at once (on a GPU a few multi-tensor launches per op, on a CPU a loop over the
        tensors). Its temporaries (the denominators, in bf16 the gradients cast up) exist for
        these units at once: ``step`` passes groups of bounded size."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        masters = [u.master for u in units]
        exp_avgs = [self.state[m]["exp_avg"] for m in masters]
        exp_avg_sqs = [self.state[m]["exp_avg_sq"] for m in masters]
        grads = [u.owned_grad().float() for u in units]  # views in fp32, cast copies in bf16
        if weight_decay:
            decayed = [u.master[a:b] for u in units for a, b in u.decay_ranges()]
            if decayed:
                torch._foreach_mul_(decayed, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(masters, exp_avgs, denom, value=-step_size)

    @torch.no_grad()
    def full_state(self) -> dict:
        """Reference-named Adam state gathered on every rank:
        {"step": int, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}."""
        out: dict = {"step": 0, "exp_avg": {}, "exp_avg_sq": {}}
        for z in self.zeros:
            for u in z.units:
                state = self.state[u.master]
                out["step"] = state["step"]
                for key in ("exp_avg", "exp_avg_sq"):
                    out[key].update(unflatten(u, gather_owned(z, u, state[key])))
        return out


# ---------------------------------------------------------------------------------------------
# Gathering a unit


@torch.no_grad()
def gather_owned(zero: ZeroModel, u: FlatUnit, t: torch.Tensor) -> torch.Tensor:
    """The full (padded,) tensor of which `t` is this rank's owned part of unit `u`."""
    if zero.stage == 0:
        return t.clone()
    out = torch.empty(u.padded, dtype=t.dtype, device=t.device)
    all_gather_single(out, t.contiguous(), group=u.group)
    return out


def unflatten(u: FlatUnit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Unit-flat (padded,) tensor -> {reference name: tensor shaped like the parameter}."""
    return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape).clone() for s in u.slots}


# ---------------------------------------------------------------------------------------------
# Memory accounting


def memory_report(zero: ZeroModel) -> dict[str, int]:
    """Model-state bytes this rank holds between steps, from the unit layout."""
    c = zero.dtype.itemsize
    mixed = zero.dtype != torch.float32
    params = grads = optimizer = 0
    for u in zero.units:
        owned = u.own_hi - u.own_lo
        params += c * (u.shard_numel if zero.stage == 3 else u.padded)
        grads += c * (u.shard_numel if zero.stage >= 2 else u.padded)
        optimizer += 4 * owned * (3 if mixed else 2)  # (master +) m + v, fp32
    return {"params": params, "grads": grads, "optimizer": optimizer}


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the distinct, still allocated storages behind `tensors` not yet in `seen`."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total

