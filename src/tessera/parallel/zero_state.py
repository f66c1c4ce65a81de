"""ZeRO's optimizer over flat shards, checkpoint gathering, and model-state memory accounting.

``ShardedAdamW`` steps each unit's fp32 master shard with ``torch.optim.AdamW``'s update
(decoupled weight decay, then the bias-corrected moment update), so on the elements it owns a
rank computes what a replicated AdamW would. Weight decay applies to the ranges of the shard
that hold matrices (as ``tessera.optim.adamw`` does). The units are updated in groups of at most
2²⁶ owned elements (``tessera.parallel.update_batches``, which bounds the update's
temporaries), in one of two ways, chosen as the per-parameter optimizer chooses
(``tessera.optim.uses_fused_adamw``):

- fused, where every master lives on CUDA: torch's fused AdamW kernel (the public functional
  ``torch.optim.adamw.adamw(fused=True)``) over the group's masters, moments and gradients, one
  pass over the state, after one multi-tensor multiply that decays the matrix ranges;
- elsewhere, the single-tensor AdamW's arithmetic op by op, each op once over the group's
  tensors (``torch._foreach_*``: decay over every decayed range, lerp, mul, addcmul, sqrt,
  div, add, addcdiv), on CPU bit for bit the single-tensor loop that the parity tests'
  references run.

In bf16 each unit's gradient is cast up to fp32 first. After the step the ``ZeroModel``s
publish the new weights (``zero.publish_unit_parameters``: one multi-tensor cast copy, and
all-gathers at stages 1-2).

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
from torch.optim.adamw import adamw as torch_adamw

from tessera import optim
from tessera.collectives.algorithms import all_gather_single
from tessera.config import TrainConfig
from tessera.parallel.update_batches import update_batches
from tessera.parallel.zero import ZeroModel, publish_unit_parameters, zero_unit_grads
from tessera.parallel.zero_units import FlatUnit


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW on each ZeRO unit's fp32 master shard; one param group (the lr scheduler's).

    `zero`: one ``ZeroModel``, or several (the chunks a pipeline rank holds); their units are
    stepped in order and each model publishes its new parameters after the step. `fused`:
    update with torch's fused AdamW kernel (True) or with multi-tensor ops (False); None (the
    default) follows ``optim.uses_fused_adamw`` on the masters' devices: fused on CUDA.

    ``state[master]`` holds the unit's int ``step`` and its ``exp_avg`` and ``exp_avg_sq``
    (what checkpoints and ``full_state`` read). The fused kernel reads and advances a step
    count on the device; those 0-d tensors are kept apart, each with the value the host last
    gave it, and refilled only where ``state[master]["step"]`` changed otherwise (a resumed
    checkpoint): no read of the device per unit or per step."""

    def __init__(self, zero: ZeroModel | Sequence[ZeroModel], cfg: TrainConfig,
                 eps: float = 1e-8, fused: bool | None = None):
        defaults = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=eps,
                        weight_decay=cfg.weight_decay)
        self.zeros = [zero] if isinstance(zero, ZeroModel) else list(zero)
        self.units = [u for z in self.zeros for u in z.units]
        super().__init__([u.master for u in self.units], defaults)
        # Moments are allocated up front so memory accounting sees them from the start.
        for u in self.units:
            self.state[u.master] = {"step": 0, "exp_avg": torch.zeros_like(u.master),
                                    "exp_avg_sq": torch.zeros_like(u.master)}
        if fused is None:
            fused = optim.uses_fused_adamw({u.master.device.type for u in self.units})
        self.fused = fused
        self._device_steps: dict[torch.Tensor, torch.Tensor] = {}  # master -> 0-d fp32 count
        self._device_step_values: dict[torch.Tensor, int] = {}  # what each count holds

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
        training) are updated together, in groups of at most ``UPDATE_BATCH_ELEMENTS`` owned
        elements (``tessera.parallel.update_batches``), by the fused kernel or by multi-tensor
        ops (``self.fused``), then the models publish their parameters
        (``zero.publish_unit_parameters``: one multi-tensor copy of the masters)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = self._update_fused if self.fused else self._update
        for group in self.param_groups:
            by_step: dict[int, list[FlatUnit]] = {}
            for u in self.units:
                state = self.state[u.master]
                state["step"] += 1
                by_step.setdefault(int(state["step"]), []).append(u)
            for step, units in by_step.items():
                for batch in update_batches([u.master.numel() for u in units]):
                    update([units[i] for i in batch], step, group)
        publish_unit_parameters(self.zeros)
        return loss

    @staticmethod
    def _decay(units: list[FlatUnit], lr: float, weight_decay: float) -> None:
        """Decoupled weight decay of the units' matrix ranges: one multi-tensor multiply by
        1 - lr · weight_decay."""
        if weight_decay:
            decayed = [u.master[a:b] for u in units for a, b in u.decay_ranges()]
            if decayed:
                torch._foreach_mul_(decayed, 1 - lr * weight_decay)

    def _update(self, units: list[FlatUnit], step: int, group: dict) -> None:
        """AdamW's update of `units`, all at step count `step`: per element the single-tensor
        AdamW's ops in the same order (on CPU bit for bit), each op applied to all the units'
        tensors at once (on a GPU a few multi-tensor launches per op, on a CPU a loop over the
        tensors). Its temporaries (the denominators, in bf16 the gradients cast up) exist for
        these units at once: ``step`` passes groups of bounded size."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        masters = [u.master for u in units]
        exp_avgs = [self.state[m]["exp_avg"] for m in masters]
        exp_avg_sqs = [self.state[m]["exp_avg_sq"] for m in masters]
        grads = [u.owned_grad().float() for u in units]  # views in fp32, cast copies in bf16
        self._decay(units, lr, group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(masters, exp_avgs, denom, value=-step_size)

    def _update_fused(self, units: list[FlatUnit], step: int, group: dict) -> None:
        """AdamW's update of `units`, all at step count `step`, by torch's fused kernel (one
        pass over masters, moments and gradients; in bf16 the gradients cast up to fp32 first,
        as the kernel wants them in the masters' dtype). The kernel runs with weight_decay=0
        after ``_decay`` has multiplied the matrix ranges by 1 - lr · weight_decay: AdamW's
        decoupled decay is that multiplication, applied to the parameter before the moment
        update and independent of it, so the two together compute AdamW's step. The result is
        the multi-tensor path's formula, rounded in another order (a few ulps apart)."""
        masters = [u.master for u in units]
        grads = [u.owned_grad().float() for u in units]  # views in fp32, cast copies in bf16
        self._decay(units, group["lr"], group["weight_decay"])
        beta1, beta2 = group["betas"]
        torch_adamw(
            masters, grads, [self.state[m]["exp_avg"] for m in masters],
            [self.state[m]["exp_avg_sq"] for m in masters], [],
            self._device_step_counts(masters, step - 1), fused=True, amsgrad=False,
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=0.0, eps=group["eps"],
            maximize=False)
        for m in masters:  # the kernel added one to each count
            self._device_step_values[m] = step

    def _device_step_counts(self, masters: list[torch.Tensor], before: int) -> list[torch.Tensor]:
        """The fused kernel's 0-d step counts of `masters`, each holding `before` (the kernel
        adds one before it uses them): made on the master's device the first time, refilled
        (a fill, no read back) where the host's value differs, else left as they are."""
        counts = []
        for m in masters:
            count = self._device_steps.get(m)
            if count is None:
                count = torch.full((), float(before), dtype=torch.float32, device=m.device)
                self._device_steps[m] = count
            elif self._device_step_values[m] != before:
                count.fill_(float(before))
            self._device_step_values[m] = before
            counts.append(count)
        return counts

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

