"""Every check a run passes before any process starts, and the report of a dry run.

``check_run`` is what ``tessera train`` asks before it launches ranks (and each rank again
before its first collective), what ``tessera train --dry-run`` and ``tessera config --check``
report on:

- the rules that tie the configuration's fields together, the layout for the world size
  included (``tessera.layout.validate``, run here once per process; it also bounds the
  pipeline's (micro-batch, chunk) pairs);
- the prepared data (:func:`check_data`: the vocabulary, a step's global batch against the
  train split, the validation windows against the val split);
- the observability options this machine serves;
- the run directory (``tessera.run_dir``): the output directory a run without one gets, which
  checkpoint it continues from and its run id (``run_dir.run_start``), no other run's
  checkpoints where it would write (``run_dir.check_run_dir``), and the checkpoint a resume
  would read (checksums, model, global batch);
- memory: the planner's bytes per rank for tessera's own engine (``tessera.planner.engine``:
  parameters, gradients and optimizer state as ``parallelize`` allocates them, activations as
  the block saves them times the schedule's in-flight peak; a mixture of experts adds its
  experts' state as the planner does), summed over the ranks that share this machine's memory
  (CPU ranks) or per GPU, against what the machine has. Python's and torch's own memory per
  process is not counted, so a run refused here cannot fit.

Failures raise ``ConfigError`` / ``DataError`` / ``CheckpointError`` with one line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tessera.config import Config
from tessera.config_warnings import config_warnings
from tessera.data.loader import TokenDataset
from tessera.errors import ConfigError, Verbatim
from tessera.layout import validate as validate_layout
from tessera.metrics import memory_snapshot_refusal, tensorboard_missing
from tessera.parallel.compile import compiler_missing
from tessera.run_dir import RunStart, check_run_dir, run_start, with_out_dir

GIB, MIB = 2**30, 2**20
BYTES_HARDWARE = "H100"
"""The catalog entry the memory estimate is made on: tessera's byte counts depend on the
model, layout and precision only, never on the hardware's rates."""


@dataclass
class RankMemory:
    """The planner's bytes on one pipeline rank (each of its dp, tp and cp ranks holds the same)."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    """A recomputed block's activations and ZeRO-3's gathered parameters."""
    experts: float = 0.0
    """A mixture of experts: its experts' model state beyond the active model's."""

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.transient
                + self.experts)


@dataclass
class Preflight:
    """What ``check_run`` found: all of it holds when it returns."""

    cfg: Config
    world: int
    data: str
    """How the data was checked (or why not), one line."""
    start: RunStart | None = None
    """Which checkpoint the run continues from, and its run id."""
    new_out: bool = False
    """train.out_dir is a new directory chosen for this run, still to be made
    (``run_dir.begin_out_dir``) once the run really starts."""
    dataset: TokenDataset | None = None
    """The prepared data, opened and checked (None where it was not checked)."""

    @property
    def resume(self) -> Path | None:
        return self.start.resume_from if self.start is not None else None
    memory: list[RankMemory] = field(default_factory=list)
    memory_note: str = ""
    """Why there is no memory estimate, or what it was compared with."""


def memory_per_rank(cfg: Config) -> list[RankMemory]:
    """The planner's bytes on each pipeline rank of `cfg`'s layout (no simulation: only the
    schedule's in-flight counts, in closed form or walked over a few periods)."""
    from tessera.planner.engine import layout_of
    from tessera.planner.estimate import estimate, memory_by_rank
    from tessera.planner.hardware import load_hardware
    from tessera.planner.moe import active_workload
    from tessera.planner.workload import Workload

    layout = layout_of(cfg)
    w, moe = active_workload(Workload.from_config(cfg, load_hardware(BYTES_HARDWARE)), layout,
                             cfg)
    experts = moe.expert_bytes if moe is not None else 0.0
    est = estimate(w, layout, simulate=False, check=False, bound=False)
    return [RankMemory(pp_rank=r, params=m.params, grads=m.grads, optimizer=m.optimizer,
                       activations=m.activations, transient=m.transient, experts=experts)
            for r, m in enumerate(memory_by_rank(est))]


def machine_memory(device_type: str) -> tuple[int, str] | None:
    """(bytes, where from) a rank may use: on CUDA the smallest visible GPU's memory (each rank
    has a GPU of its own), else this machine's available memory, which its ranks share
    (MemAvailable of /proc/meminfo, else os.sysconf's available pages); None if unknown."""
    if device_type == "cuda":
        import torch

        n = torch.cuda.device_count()
        least = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
        return least, f"the smallest of this machine's {n} GPUs"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "available pages (os.sysconf)")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg: Config, world: int, device_type: str, local_ranks: int
                 ) -> tuple[list[RankMemory], str]:
    """The planner's bytes per pipeline rank and a line comparing them with this machine;
    ConfigError if the ranks on this machine (`local_ranks` of `world`) cannot fit."""
    if device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            raise ConfigError("--nproc", local_ranks, f"more ranks than this machine's {gpus} "
                              "GPUs (each rank trains on a GPU of its own)")
    try:
        memory = memory_per_rank(cfg)
    except Exception as e:  # noqa: BLE001 - the estimate informs; it never fails a valid run
        return [], f"the planner could not estimate this layout's memory ({e})"
    have = machine_memory(device_type)
    per_stage = world // cfg.parallel.pp  # the dp*tp*cp ranks of each pipeline rank
    if device_type == "cuda":
        need, what = max(m.total for m in memory), "the fullest rank"
    else:
        # Each CPU rank is a process that also holds Python, torch and gloo: at least what this
        # process holds now, torch imported (~0.3 GiB here; 64 ranks of it fill 24 GiB before
        # any tensor).
        baseline = process_baseline()
        need = (sum(m.total for m in memory) * per_stage * local_ranks / world
                + baseline * local_ranks)
        what = (f"{local_ranks} ranks together" if local_ranks > 1 else "the rank") + (
            f" ({_size(baseline)} a process beside the model)" if baseline else "")
    if have is None:
        return memory, f"{what}: {_size(need)} (this machine's memory is unknown)"
    available, source = have
    if need > available:
        raise ConfigError("memory", Verbatim(_size(need)), f"the planner's "
                          f"estimate for {what} (parameters, gradients, optimizer state, "
                          f"activations, and on CPU each process's own; --dry-run lists them) "
                          f"exceeds the {_size(available)} "
                          f"this machine has ({source}); lower train.micro_batch_size, or "
                          "train.grad_accum under a pipeline, or use parallel.recompute, ZeRO "
                          "or more ranks")
    return memory, f"{what}: {_size(need)} of {_size(available)} available ({source})"


def process_baseline() -> int:
    """Resident bytes of this process (VmRSS): a lower bound on what each CPU rank holds
    before its model, since every rank imports what this process has; 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def local_ranks(world: int) -> int:
    """Ranks sharing this machine: the launcher's LOCAL_WORLD_SIZE, else all (tessera's
    --nproc starts every rank here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world)


def check_data(cfg: Config) -> TokenDataset:
    """Open and verify the prepared data: the vocabulary must fit the model's, the train split
    hold one window and a step's global batch, the val split the validation windows."""
    dataset = TokenDataset(cfg.data.path)
    if dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"must be >= the data's vocabulary {dataset.vocab_size} "
                          f"({cfg.data.path})")
    # BatchLoader draws window starts in [0, len - seq_len - 1).
    t, train_tokens = cfg.train, len(dataset.train)
    if train_tokens < cfg.data.seq_len + 2:
        raise ConfigError("data.seq_len", cfg.data.seq_len,
                          f"the train split of {cfg.data.path} holds {train_tokens} tokens, "
                          f"fewer than one training window needs (seq_len+2="
                          f"{cfg.data.seq_len + 2})")
    # A step draws dp*grad_accum*micro_batch_size windows (BatchLoader.global_batch_size);
    # more tokens than the split holds read every token more than once a step, and at the
    # sizes that get there, each rank stacks them all in memory before its first forward.
    step_tokens = cfg.parallel.dp * t.grad_accum * t.micro_batch_size * cfg.data.seq_len
    if step_tokens > train_tokens:
        name, value = max([("train.micro_batch_size", t.micro_batch_size),
                           ("train.grad_accum", t.grad_accum), ("parallel.dp", cfg.parallel.dp)],
                          key=lambda named: named[1])  # the largest factor
        raise ConfigError(name, value, f"a step's global batch, dp*grad_accum*micro_batch_size"
                          f"*seq_len = {step_tokens:,} tokens, exceeds the train split of "
                          f"{cfg.data.path} ({train_tokens:,} tokens); lower it or prepare "
                          "more data")
    # The validation windows (val_windows): ceil(val_tokens / seq_len) of them, a multiple of
    # dp, each seq_len + 1 tokens long.
    seq, dp = cfg.data.seq_len, cfg.parallel.dp
    windows = math.ceil(cfg.data.val_tokens / seq)
    windows += (-windows) % dp
    if windows * seq + 1 > len(dataset.val):
        raise ConfigError("data.val_tokens", cfg.data.val_tokens,
                          f"the val split of {cfg.data.path} holds {len(dataset.val)} tokens, "
                          f"fewer than the validation windows need ({windows * seq + 1}); lower "
                          "it or prepare with a larger --val-percent")
    return dataset


def check_options(cfg: Config, device_type: str) -> None:
    """The observability options this machine can serve (ConfigError otherwise), checked
    before any collective runs."""
    if cfg.train.tensorboard and (why := tensorboard_missing()):
        raise ConfigError("train.tensorboard", True, why)
    if cfg.train.memory_snapshot and (why := memory_snapshot_refusal(torch.device(device_type))):
        raise ConfigError("train.memory_snapshot", True, why)
    if cfg.train.compile and (why := compiler_missing(device_type)):
        raise ConfigError("train.compile", True, why)


def check_run(cfg: Config, world: int, device_type: str, data: bool = True,
              memory: bool = True) -> Preflight:
    """Every check before a run starts (module doc). `data`: check the prepared data (False:
    only if cfg.data.path exists, the report says which). `memory`: check it against this
    machine (a launched rank skips it: its launcher checked)."""
    from tessera.checkpoint import verify

    validate_layout(cfg, world)
    dataset = None
    if data or Path(cfg.data.path).exists():
        dataset = check_data(cfg)
        note = (f"checked {cfg.data.path} ({len(dataset.train):,} train, "
                f"{len(dataset.val):,} val tokens)")
    else:
        note = f"not checked: {cfg.data.path} does not exist"
    check_options(cfg, device_type)
    cfg, new_out = with_out_dir(cfg)
    start = run_start(cfg)
    check_run_dir(cfg, start)
    pre = Preflight(cfg=cfg, world=world, data=note, start=start, new_out=new_out,
                    dataset=dataset)
    if pre.resume is not None:
        verify(pre.resume, cfg, world)
    if memory:
        pre.memory, pre.memory_note = check_memory(cfg, world, device_type, local_ranks(world))
    return pre


def report_lines(pre: Preflight, command: str) -> list[str]:
    """The dry run's report: a YAML document (the resolved config) whose comment lines say
    what was checked, the memory per rank and every warning."""
    cfg, p = pre.cfg, pre.cfg.parallel
    lines = [f"# {command}: valid for {pre.world} rank{'s' * (pre.world > 1)} "
             f"(dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}); nothing started",
             f"# data: {pre.data}",
             f"# resume: {pre.resume if pre.resume is not None else 'none'}"
             + (" (checkpoint verified)" if pre.resume is not None else ""),
             f"# out: {cfg.train.out_dir}"
             + (" (a new directory, made when the run starts)" if pre.new_out else "")
             + (f"; run id {pre.start.run_id}" if pre.start is not None else "")]
    lines += yaml.safe_dump(cfg.to_dict(), sort_keys=False).splitlines()
    if pre.memory:
        experts = any(m.experts for m in pre.memory)
        lines.append("# memory per rank, the planner's estimate (MiB):")
        lines.append("#   pp rank    params     grads  optimizer  activations  transient"
                     + ("    experts" if experts else "") + "      total")
        for m in pre.memory:
            row = (f"#   {m.pp_rank:<7} {m.params / MIB:9.2f} {m.grads / MIB:9.2f} "
                   f"{m.optimizer / MIB:10.2f} {m.activations / MIB:12.2f} "
                   f"{m.transient / MIB:10.2f}")
            if experts:
                row += f" {m.experts / MIB:10.2f}"
            lines.append(row + f" {m.total / MIB:10.2f}")
    lines.append(f"# memory: {pre.memory_note}" if pre.memory_note else "# memory: not checked")
    lines += [f"# warning: {w}" for w in config_warnings(cfg)]
    return lines
