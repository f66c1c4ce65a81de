"""A config's legal but probably unintended settings, one line each for the user to read:
few micro-batches for a pipeline, warm-up longer than the run, and the options set that do
nothing in the config's layout. ``tessera train`` prints them (``warning: ...``) and
``tessera train --dry-run`` / ``tessera config --check`` list them."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from tessera.config import Config
from tessera.errors import shown
from tessera.pipeline.schedules import is_breadth_first


def config_warnings(cfg: Config) -> list[str]:
    """Legal but probably unintended settings, one line each, for the user to read: the
    ones below and :func:`ignored_options`, options set that do nothing in this layout."""
    p, t = cfg.parallel, cfg.train
    out = ignored_options(cfg)
    if p.pp > 1 and t.grad_accum < p.pp:
        # p stages and m micro-batches idle (p-1)/(m+p-1) of a step (GPipe, Huang et al.
        # 2019; 1F1B keeps it, Narayanan et al. 2021); v chunks per rank divide it by v.
        out.append(f"train.grad_accum={t.grad_accum} micro-batches with parallel.pp={p.pp}: "
                   f"pipeline ranks idle about "
                   f"{(p.pp - 1) / (t.grad_accum + p.pp - 1) / p.virtual_stages:.0%} of "
                   f"each step; use --microbatches {4 * p.pp} (4*pp) or more")
    if t.warmup_steps > t.steps:
        out.append(f"train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the "
                   f"learning rate never reaches train.lr={t.lr:g}")
    return out


def ignored_options(cfg: Config) -> list[str]:
    """One line per option set away from its default that this layout never reads (a
    field that differs from its default stands for one the user set)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    changed = {f"{section}.{f.name}" for section, obj in (("model", m), ("parallel", p),
                                                          ("train", t))
               for f in fields(obj) if f.default is not dataclasses.MISSING
               and getattr(obj, f.name) != f.default}
    out = []

    def unused(names: list[str], why: str) -> None:
        named = [n for n in names if n in changed]
        if named:
            values = ", ".join(f"{n}={shown(_get(cfg, n))}" for n in named)
            out.append(f"{values}: no effect, {why}")

    if not m.moe_experts:
        unused([f"model.{f.name}" for f in fields(m) if f.name.startswith("moe_")
                and f.name != "moe_experts"], "the model is dense (model.moe_experts=0)")
    elif m.moe_every > m.n_layers:
        out.append(f"model.moe_every={m.moe_every} > model.n_layers={m.n_layers}: no block "
                   "is a mixture of experts")
    if m.rope_scaling_factor is None:
        unused(["model.rope_low_freq_factor", "model.rope_high_freq_factor",
                "model.rope_original_max_seq_len"],
               "RoPE is not scaled (model.rope_scaling_factor is null)")
    if p.cp == 1:
        unused(["parallel.cp_method", "parallel.cp_ulysses"],
               "no context parallelism (parallel.cp=1)")
    elif p.cp_method != "hybrid":
        unused(["parallel.cp_ulysses"], f"only cp_method='hybrid' reads it, not "
                                        f"{p.cp_method!r}")
    if p.tp == 1:
        unused(["parallel.sequence_parallel"], "no tensor parallelism (parallel.tp=1)")
    if p.tp == 1 or p.pp == 1 or p.sequence_parallel:
        unused(["parallel.scatter_gather"],
               "no tensor parallelism (parallel.tp=1)" if p.tp == 1 else
               "one pipeline stage (parallel.pp=1) sends nothing" if p.pp == 1 else
               "sequence parallelism already sends 1/tp of each activation")
    if p.ep == 1:
        unused(["parallel.ep_alltoall"], "no expert parallelism (parallel.ep=1)")
    if p.dp_mode != "ps-async":
        unused(["parallel.max_staleness"], f"only dp_mode='ps-async' reads it, not "
                                           f"{p.dp_mode!r}")
    if p.pp == 1 and p.virtual_stages == 1:
        unused(["parallel.schedule", "parallel.microbatch_group", "parallel.stage_layout"],
               "one pipeline stage (parallel.pp=1, virtual_stages=1) runs its micro-batches "
               "one after the other")
    elif p.pp == 1 and not (p.zero_stage == 3 and is_breadth_first(p.schedule)):
        unused(["parallel.virtual_stages"], "one pipeline rank (parallel.pp=1) runs its "
               "chunks one after the other, as one (only breadth-first ZeRO-3 gathers by "
               "chunk)")
    if p.dp * p.cp == 1:
        unused(["parallel.zero_stage", "parallel.bucket_mb", "parallel.allreduce_algorithm"],
               "one data-parallel rank (parallel.dp*cp=1) has nothing to shard or reduce")
    elif p.dp_mode != "allreduce" or p.zero_stage > 0 or t.precision == "bf16":
        user = (f"dp_mode={p.dp_mode!r}" if p.dp_mode != "allreduce" else
                f"ZeRO (zero_stage={p.zero_stage}, precision={t.precision})")
        unused(["parallel.bucket_mb", "parallel.allreduce_algorithm"],
               f"only the all-reduce data parallelism (DDP) reads it, not {user}")
    if not t.checkpoint_interval:
        unused(["train.keep_checkpoints", "train.async_checkpoint"],
               "no checkpoints are saved (train.checkpoint_interval=0)")
        if not t.resume:
            unused(["train.checkpoint_dir"], "no checkpoints are saved or resumed "
                                             "(train.checkpoint_interval=0, no train.resume)")
    if not t.sample_tokens:
        unused(["train.sample_prompt"], "no sample is generated (train.sample_tokens=0)")
    return out


def _get(cfg: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)
