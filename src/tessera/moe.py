"""Mixture-of-experts feed-forward: router → dispatcher → experts → combine. Unaware of ranks.

Papers: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2021, GShard (top-2 gates,
expert capacity per routing group, token dropping); Fedus et al. 2022, Switch Transformer (top-1
routing and the load-balancing loss E·Σₑ fₑ·Pₑ); Zoph et al. 2022, ST-MoE (router z-loss);
DeepSeek-AI 2024, DeepSeek-V3 (auxiliary-loss-free balancing with a per-expert routing bias);
Dai et al. 2024, DeepSeekMoE (a shared expert every token goes through).

One MoE layer replaces a block's SwiGLU feed-forward (``ModelConfig.moe_every``):

1. **router**: logits = x·Wᵣᵀ (fp32), probabilities p = softmax(logits); each token picks its
   top-k experts by p (plus the balancing bias, which only selects, DeepSeek-V3). Gates are the
   chosen p, renormalized to sum to 1 when k > 1 (GShard, Mixtral).
2. **capacity**: a routing group is one sequence (GShard's groups), so what is dropped depends
   on the sequence alone, never on how the batch is split over micro-batches or ranks. Each
   expert takes at most ⌈C·T·k/E⌉ assignments per sequence; priority goes to every token's
   first choice before any second choice, then by position. C = 0 is dropless. A dropped
   assignment contributes nothing (the token keeps its residual).
3. **dispatcher**: the kept assignments, sorted by expert, go to the experts and come back in
   the same order. Here a local call; expert parallelism swaps this submodule for an
   all-to-all one over the ep group (``tessera.parallel.expert_parallel``), as context
   parallelism swaps ``AttentionCore``.
4. **experts**: E SwiGLU MLPs as stacked weights w1, w3 (E, h, f) and w2 (E, f, h), so that a
   shard of experts is a slice along dim 0 of the reference tensor (reference names
   ``layers.{i}.feed_forward.experts.w1``).
5. **combine**: y = Σ over a token's kept assignments of gate · expert output, plus the shared
   expert's output when there is one.

Auxiliary losses enter without the runtime knowing (Megatron-LM's approach): the layer's output
passes through ``AttachAuxLoss``, the identity forward, whose backward also sends
``loss_scale · (aux_coef·aux + z_coef·z)``'s gradient into the router. ``loss_scale`` is the
factor the step applies to the micro-batch's loss (1/m); both losses are means over the
micro-batch's sequences (tokens), so micro-batch and data-parallel means of them are the
whole batch's, exactly as for the cross-entropy.

- load-balancing loss per sequence b: E·Σₑ f_b,e·P_b,e, f = share of the sequence's k·T
  assignments routed to e (before dropping, not differentiable), P = mean router probability;
  averaged over sequences.
- z-loss: mean over tokens of logsumexp(logits)².
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; in backward, d(loss)/d(aux) = `scale` (the loss of the step includes
    scale·aux, the same scale the micro-batch's cross-entropy gets)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                                device=grad.device), None


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: w1, w3 (E, h, f), w2 (E, f, h).

    ``first``: the reference index of the first expert held (expert parallelism keeps a slice
    of experts; a single device holds them all)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.first = 0

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (S, h): rows grouped by held expert, counts[e] rows for held expert e -> (S, h).
        Every expert's weights enter the graph (an expert with no rows gets a zero gradient).
        The stacks are unbound once: the backward stacks the E slices' gradients into one
        tensor per weight, where indexing each slice would write a zero-filled (E, ...)
        gradient per expert and sum E of them."""
        w1, w3, w2 = self.w1.unbind(), self.w3.unbind(), self.w2.unbind()
        outs = []
        for e, xe in enumerate(x.split(counts)):  # xe (S_e, h)
            hidden = F.silu(xe @ w1[e]) * (xe @ w3[e])  # (S_e, f)
            outs.append(hidden @ w2[e])  # (S_e, h)
        return torch.cat(outs)


class LocalDispatcher(nn.Module):
    """The single-device dispatcher: every expert is here, the sorted rows go straight in."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """x (S, h) sorted by expert; counts (E,) rows per expert -> expert outputs (S, h)."""
        return experts(x, counts.tolist())


class SwiGLU(nn.Module):
    """The dense SwiGLU MLP (the shared expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEStats:
    """What a layer routed in training since the last ``reset``: assignments per expert before
    dropping, dropped assignments, and the auxiliary losses' running sums (for metrics)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.float64, device="cpu")
        self.dropped = 0.0
        self.aux_sum = self.z_sum = 0.0
        self.calls = 0

    @property
    def assignments(self) -> float:
        return float(self.tokens_per_expert.sum())


class MoEFeedForward(nn.Module):
    """Router → dispatcher → experts → combine (module doc). x (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.bias_rate = cfg.moe_router_bias_rate
        hidden = cfg.moe_ffn_hidden or cfg.ffn_hidden
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = Experts(cfg.moe_experts, cfg.d_model, hidden)
        self.dispatcher: nn.Module = LocalDispatcher()
        self.shared_expert = SwiGLU(cfg.d_model, cfg.ffn_hidden) if cfg.moe_shared_expert \
            else None
        # DeepSeek-V3's balancing bias: changes which experts are chosen, never the gates.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        self.loss_scale = 1.0
        """The factor the step applies to this micro-batch's loss (the executor sets 1/m)."""
        self.stats = MoEStats(cfg.moe_experts)
        self.step_load = torch.zeros(cfg.moe_experts, dtype=torch.float64, device="cpu")
        """Assignments per expert since the last router-bias update."""
        self.replaying = False
        """True while activation recomputation runs this forward again in backward
        (``tessera.parallel.recompute`` sets it): the replay routes the same tokens again and
        records nothing, so the statistics and the load count each real forward once."""

    def capacity(self, seq_len: int) -> int | None:
        """Assignments one expert takes per sequence; None when dropless."""
        if self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Routing decisions for x (B, T, h): experts (B, T, k), gates (B, T, k) fp32, keep
        (B, T, k) bool, and the fp32 logits and probabilities (B, T, E)."""
        B, T, _ = x.shape
        E, k = self.n_experts, self.top_k
        logits = F.linear(x.float(), self.router.weight.float())  # (B, T, E)
        probs = logits.softmax(-1)
        choose = probs + self.expert_bias if self.bias_rate > 0 else probs
        experts = choose.topk(k, dim=-1).indices  # (B, T, k)
        gates = probs.gather(-1, experts)
        if k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        keep = torch.ones_like(experts, dtype=torch.bool)
        cap = self.capacity(T)
        if cap is not None:
            onehot = F.one_hot(experts, E).transpose(1, 2).reshape(B, k * T, E)  # choice-major
            position = (onehot.cumsum(1) * onehot).sum(-1)  # (B, k·T), 1-based per expert
            keep = (position <= cap).view(B, k, T).transpose(1, 2)  # (B, T, k)
        return dict(experts=experts, gates=gates, keep=keep, logits=logits, probs=probs)

    def aux_losses(self, r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss), each a mean over this batch's sequences/tokens."""
        B, T, k = r["experts"].shape
        counts = F.one_hot(r["experts"], self.n_experts).sum((1, 2))  # (B, E)
        share = counts.float() / (T * k)  # f
        mean_prob = r["probs"].mean(1)  # P, (B, E)
        balance = self.n_experts * (share * mean_prob).sum(-1).mean()
        z = torch.logsumexp(r["logits"], -1).pow(2).mean()
        return balance, z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        r = self.route(x)
        k = self.top_k
        flat_experts = r["experts"].reshape(-1)  # (B·T·k,)
        token = torch.arange(B * T, device=x.device).repeat_interleave(k)
        kept = r["keep"].reshape(-1).nonzero().squeeze(1)
        order = kept[flat_experts[kept].argsort(stable=True)]  # kept assignments by expert
        counts = torch.bincount(flat_experts[order], minlength=self.n_experts)  # (E,)
        rows = token[order]
        x_flat = x.reshape(B * T, h)
        out = self.dispatcher(x_flat[rows], counts, self.experts)  # (S, h)
        gate = r["gates"].reshape(-1)[order].to(out.dtype)
        y = torch.zeros_like(x_flat).index_add(0, rows, out * gate[:, None])
        y = y.view(B, T, h)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        balance, z = self.aux_losses(r)
        self._record(r, balance, z)
        if torch.is_grad_enabled() and (self.aux_coef > 0 or self.z_coef > 0):
            y = AttachAuxLoss.apply(y, self.aux_coef * balance + self.z_coef * z,
                                    self.loss_scale)
        return y

    @torch.no_grad()
    def _record(self, r: dict[str, torch.Tensor], balance: torch.Tensor,
                z: torch.Tensor) -> None:
        # Evaluation passes do not count in the training load, replays count in the forward's.
        if not self.training or self.replaying:
            return
        load = torch.bincount(r["experts"].reshape(-1), minlength=self.n_experts).double().cpu()
        s = self.stats
        s.tokens_per_expert += load
        s.dropped += float((~r["keep"]).sum())
        s.aux_sum += float(balance)
        s.z_sum += float(z)
        s.calls += 1
        self.step_load += load


def moe_layers(module: nn.Module) -> Iterator[MoEFeedForward]:
    """Every MoE feed-forward inside `module`, in module order."""
    for m in module.modules():
        if isinstance(m, MoEFeedForward):
            yield m


def materialize_buffers(module: nn.Module) -> None:
    """Give MoE layers built on the meta device real (zero) routing biases."""
    for m in moe_layers(module):
        if m.expert_bias.is_meta:
            m.expert_bias = torch.zeros(m.n_experts)


def set_loss_scale(module: nn.Module, scale: float) -> None:
    """Tell every MoE layer of `module` the factor the step applies to a micro-batch's loss."""
    for m in moe_layers(module):
        m.loss_scale = scale


@torch.no_grad()
def update_router_bias(modules: list[nn.Module], group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's bias
    moves by `moe_router_bias_rate` toward balance, bᵢ += rate·sign(mean load − loadᵢ), with the
    load of the whole global batch (summed over `group`, the data-parallel ranks), so every
    replica applies the same update."""
    layers = [m for module in modules for m in moe_layers(module) if m.bias_rate > 0]
    if not layers:
        return
    load = torch.stack([m.step_load for m in layers])  # (layers, E)
    if group is not None and dist.get_world_size(group) > 1:
        load = load.to(layers[0].expert_bias.device)
        dist.all_reduce(load, group=group)
    for m, row in zip(layers, load.cpu(), strict=True):
        m.expert_bias += (m.bias_rate * torch.sign(row.mean() - row)).to(m.expert_bias)
        m.step_load.zero_()


def collect_stats(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Summed over the MoE layers of `modules`: tokens per expert (E,), dropped assignments,
    all assignments, summed aux and z losses and the number of layer calls (fp64 tensors, to be
    summed over ranks). Clears the layers' counters."""
    layers = [m for module in modules for m in moe_layers(module)]
    if not layers:
        return {}
    out = {"tokens_per_expert": sum(m.stats.tokens_per_expert for m in layers),
           "dropped": torch.tensor(sum(m.stats.dropped for m in layers), dtype=torch.float64),
           "assignments": torch.tensor(sum(m.stats.assignments for m in layers),
                                       dtype=torch.float64),
           "aux": torch.tensor(sum(m.stats.aux_sum for m in layers), dtype=torch.float64),
           "z": torch.tensor(sum(m.stats.z_sum for m in layers), dtype=torch.float64),
           "calls": torch.tensor(sum(m.stats.calls for m in layers), dtype=torch.float64)}
    for m in layers:
        m.stats.reset()
    return out


def reduce_stats(modules: list[nn.Module], groups: list[dist.ProcessGroup | None],
                 n_experts: int) -> dict[str, torch.Tensor]:
    """``collect_stats`` (resetting the counters) summed over `groups` (every rank of each group
    calls, also one whose chunks hold no MoE layer): the data-parallel group for the whole
    batch's tokens, the pipeline group for every layer. Tensor-parallel peers route identical
    copies and are not summed."""
    stats = collect_stats(modules) or {
        "tokens_per_expert": torch.zeros(n_experts, dtype=torch.float64),
        **{k: torch.zeros((), dtype=torch.float64)
           for k in ("dropped", "assignments", "aux", "z", "calls")}}
    keys = list(stats)
    flat = torch.cat([stats[k].reshape(-1) for k in keys])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
    out, at = {}, 0
    for k in keys:
        n = stats[k].numel()
        out[k] = flat[at:at + n].reshape(stats[k].shape)
        at += n
    return out


def summarize_load(stats: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """Metrics from ``collect_stats`` (already summed over ranks): tokens per expert, the
    busiest expert's share over the mean, the dropped fraction, the mean aux and z losses."""
    load = stats["tokens_per_expert"]
    calls = max(float(stats["calls"]), 1.0)
    return {"moe_tokens_per_expert": [float(v) for v in load],
            "moe_max_load_ratio": float(load.max() / load.mean()) if load.sum() > 0 else 0.0,
            "moe_dropped_fraction": float(stats["dropped"] / max(float(stats["assignments"]),
                                                                 1.0)),
            "moe_aux_loss": float(stats["aux"]) / calls,
            "moe_z_loss": float(stats["z"]) / calls}
