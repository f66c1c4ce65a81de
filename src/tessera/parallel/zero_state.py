"""ZeRO's optimizer over flat shards, checkpoint gathering, and model-state memory accounting.

``ShardedAdamW`` steps each unit's fp32 master shard with exactly the arithmetic of
``torch.optim.AdamW`` (single-tensor path: decoupled weight decay, then the bias-corrected
moment update), so on the elements it owns a rank computes what a replicated AdamW would. Weight
decay applies to the ranges of the shard that hold matrices (as ``tessera.optim.adamw`` does).
After the step it asks the ``ZeroModel`` to publish the new weights (cast, and all-gather at
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
from tessera.parallel.zero import ZeroModel
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
        """Zero the units' gradient buffers (they are reused, never set to None)."""
        for z in self.zeros:
            z.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            for u in self.units:
                master, state = u.master, self.state[u.master]
                state["step"] += 1
                step = float(state["step"])
                grad = u.owned_grad().float()  # a view in fp32, a cast copy in bf16
                if weight_decay:
                    for a, b in u.decay_ranges():
                        master[a:b].mul_(1 - lr * weight_decay)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
                denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
                master.addcdiv_(state["exp_avg"], denom, value=-step_size)
        for z in self.zeros:
            z.publish_parameters()
        return loss

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

