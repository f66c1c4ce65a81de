"""The `tessera` command line.

    tessera train [--preset NAME] [--config FILE] [--set section.field=value ...]
                  [--nproc N] [--dp N] [--tp N] [--pp N] [--cp N] ...
    tessera data prepare [--source stdlib|PATH ...] [--out DIR] [--tokenizer byte|FILE]
    tessera config [--preset NAME] [--config FILE] [--set ...]     print the resolved config
    tessera schedule --schedule NAME --pp P --microbatches M [--virtual V] [--out DIR]

Bad input (a config rule, a missing data path, an unknown preset) prints one line,
``error: <field>=<value>: <rule>``, and exits with code 2, on every rank, before any collective.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
import yaml

from tessera.config import Config, ConfigError, make_config

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="tessera: train transformers across devices.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare training data.")
app.add_typer(data_app, name="data")

from tessera.planner.cli import plan_app  # noqa: E402  (the planner's commands, tessera plan)

app.add_typer(plan_app, name="plan")

EXIT_BAD_INPUT = 2


def fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return typer.Exit(EXIT_BAD_INPUT)


Preset = Annotated[str | None, typer.Option(help="Named preset: tiny, demo, gpt2-124m, llama-1b.")]
ConfigFile = Annotated[str | None, typer.Option("--config", help="TOML or YAML config file.")]
Sets = Annotated[list[str] | None, typer.Option(
    "--set", help="Override one field: section.field=value (repeatable).")]


def resolve_config(preset: str | None, config_file: str | None, sets: list[str] | None,
                   flags: dict[str, dict], nproc: int | None = None) -> Config:
    """Preset < file < flags < --set. With --nproc and no explicit --dp, dp fills the world."""
    sections = {k: {f: v for f, v in d.items() if v is not None} for k, d in flags.items()}
    preset = preset if preset or not config_file else None
    fill_dp = nproc is not None and "dp" not in sections.get("parallel", {}) and not any(
        s.startswith("parallel.dp=") for s in sets or [])
    if fill_dp:
        # A first build with dp = nproc reads tp, pp and cp (no rule on dp gets harder as dp
        # grows: a parameter server needs dp >= 2, so dp = 1 must not be tried first).
        trial = {**sections, "parallel": {**sections.get("parallel", {}), "dp": nproc}}
        p = make_config(preset, config_file, sets or [], **trial).parallel
        others = p.tp * p.pp * p.cp
        if nproc % others == 0:
            sections.setdefault("parallel", {})["dp"] = nproc // others
    cfg = make_config(preset, config_file, sets or [], **sections)
    return cfg


@app.command()
def train(
    preset: Preset = "demo",
    config: ConfigFile = None,
    set_: Sets = None,
    nproc: Annotated[int | None, typer.Option(
        help="Ranks to launch on this machine (torch's elastic launcher); "
             "default dp*tp*pp*cp.")] = None,
    dp: Annotated[int | None, typer.Option(help="Data-parallel degree.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline-parallel degree.")] = None,
    cp: Annotated[int | None, typer.Option(help="Context-parallel degree.")] = None,
    cp_method: Annotated[str | None, typer.Option(
        help="Context-parallel attention: ring, allgather, ulysses, hybrid.")] = None,
    cp_ulysses: Annotated[int | None, typer.Option(
        help="cp-method hybrid: Ulysses degree inside the cp group.")] = None,
    zero_stage: Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")] = None,
    dp_mode: Annotated[str | None, typer.Option(help="allreduce, ps or ps-async.")] = None,
    bucket_mb: Annotated[float | None, typer.Option(
        help="DDP gradient bucket size in MiB.")] = None,
    allreduce_algorithm: Annotated[str | None, typer.Option(
        help="DDP all-reduce: backend, auto, naive, parallel, ring, rabenseifner.")] = None,
    max_staleness: Annotated[int | None, typer.Option(
        help="ps-async: drop gradients more than this many server updates old.")] = None,
    sequence_parallel: Annotated[bool | None, typer.Option(
        "--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism.")
    ] = None,
    schedule: Annotated[str | None, typer.Option(
        help="Pipeline schedule: naive, gpipe, 1f1b, interleaved, bfs.")] = None,
    microbatches: Annotated[int | None, typer.Option(
        help="Micro-batches per step per dp rank (gradient accumulation; the pipeline's m).")
    ] = None,
    virtual: Annotated[int | None, typer.Option(help="Virtual stages per pipeline rank.")] = None,
    recompute: Annotated[str | None, typer.Option(
        help="Activation recomputation: none, selective (attention core), full (each block).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps.")] = None,
    checkpoint_interval: Annotated[int | None, typer.Option(
        help="Save a checkpoint every N steps and at the end (under <out>/checkpoints).")
    ] = None,
    resume: Annotated[str | None, typer.Option(
        help="Continue from a checkpoint directory, or 'latest' (the newest, if any).")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch.")
                                ] = None,
    precision: Annotated[str | None, typer.Option(help="fp32 or bf16.")] = None,
    peak_tflops: Annotated[float | None, typer.Option(
        help="Peak TFLOP/s of one device, for MFU.")] = None,
    data: Annotated[str | None, typer.Option(help="Prepared data directory.")] = None,
    out: Annotated[str | None, typer.Option(help="Output directory for metrics and sample.")
                   ] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar.")] = False,
) -> None:
    """Train a model; launches --nproc ranks itself unless already under torchrun."""
    flags = {
        "parallel": dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_method=cp_method,
                         cp_ulysses=cp_ulysses, zero_stage=zero_stage, dp_mode=dp_mode,
                         bucket_mb=bucket_mb, allreduce_algorithm=allreduce_algorithm,
                         max_staleness=max_staleness,
                         sequence_parallel=sequence_parallel, schedule=schedule,
                         virtual_stages=virtual, recompute=recompute),
        "train": dict(steps=steps, grad_accum=microbatches, micro_batch_size=micro_batch_size,
                      precision=precision, peak_tflops=peak_tflops, out_dir=out,
                      checkpoint_interval=checkpoint_interval, resume=resume),
        "data": dict(path=data),
    }
    from tessera.checkpoint import CheckpointError, verify
    from tessera.data.loader import DataError
    from tessera.trainer import check_data, resume_path

    under_launcher = "RANK" in os.environ
    try:
        # Under a launcher the world is known; dp fills it unless given, as with --nproc.
        world_hint = int(os.environ["WORLD_SIZE"]) if under_launcher else nproc
        cfg = resolve_config(preset, config, set_, flags, world_hint)
        world = int(os.environ["WORLD_SIZE"]) if under_launcher else (
            nproc or cfg.parallel.world_size)
        cfg.validate(world)
        check_data(cfg)
        resume_from = resume_path(cfg)
        if resume_from is not None:
            verify(resume_from, cfg, world)
    except (ConfigError, DataError, CheckpointError) as e:
        raise fail(str(e)) from None

    if not under_launcher and world > 1:
        from tessera.launch import launch

        argv = [a for a in sys.argv[1:] if a != "train"]
        raise typer.Exit(launch(world, strip_option(argv, "--nproc")))

    from tessera.trainer import run

    try:
        run(cfg, progress=not no_progress)
    except (ConfigError, DataError, CheckpointError) as e:
        raise fail(str(e)) from None


def strip_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


@app.command("schedule")
def schedule_cmd(
    schedule: Annotated[str, typer.Option(
        help="Pipeline schedule: naive, gpipe, 1f1b, interleaved, bfs.")] = "1f1b",
    pp: Annotated[int, typer.Option(help="Pipeline ranks.")] = 4,
    microbatches: Annotated[int, typer.Option(help="Micro-batches per step.")] = 8,
    virtual: Annotated[int, typer.Option(help="Chunks per rank (interleaved, bfs).")] = 1,
    out: Annotated[str | None, typer.Option(help="Write the PNG timeline and trace here.")
                   ] = None,
    file: Annotated[str | None, typer.Option(
        help="A custom schedule in the string form ('rank 0: 0F0 0B0 ...').")] = None,
    backward_ratio: Annotated[float, typer.Option(help="Backward time / forward time.")] = 2.0,
    dp_reduce: Annotated[float, typer.Option(
        help="Data-parallel gradient reduction per rank's layers, in forward-time units.")
    ] = 0.0,
    zero_stage: Annotated[int, typer.Option(
        help="3: add ZeRO-3's UNSHARD / RESHARD / REDUCE_GRAD actions and count them.")] = 0,
    gather: Annotated[float, typer.Option(
        help="ZeRO-3 parameter all-gather per rank's layers, in forward-time units.")] = 0.0,
) -> None:
    """Print a pipeline schedule's grid, bubble and in-flight memory; draw its timeline."""
    from tessera.pipeline.cli import describe, load_schedule
    from tessera.pipeline.schedule import ScheduleError

    try:
        if backward_ratio <= 0:
            raise ConfigError("--backward-ratio", backward_ratio, "must be > 0")
        for flag, value in (("--dp-reduce", dp_reduce), ("--gather", gather)):
            if value < 0:
                raise ConfigError(flag, value, "must be >= 0")
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError("--zero-stage", zero_stage, "must be 0, 1, 2 or 3")
        if gather and zero_stage != 3:
            raise ConfigError("--gather", gather, "parameter all-gathers need --zero-stage 3")
        print(describe(load_schedule(schedule, pp, microbatches, virtual, file),
                       backward_ratio, dp_reduce, out, zero_stage, gather))
    except (ConfigError, ScheduleError) as e:
        raise fail(str(e)) from None


@app.command("config")
def show_config(preset: Preset = "demo", config: ConfigFile = None, set_: Sets = None) -> None:
    """Print the resolved configuration as YAML."""
    try:
        cfg = resolve_config(preset, config, set_, {})
    except ConfigError as e:
        raise fail(str(e)) from None
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")


@data_app.command("prepare")
def data_prepare(
    source: Annotated[list[str] | None, typer.Option(
        help="'stdlib' (this Python's standard library) or a file/directory; repeatable.")
    ] = None,
    out: Annotated[str, typer.Option(help="Output directory.")] = "data/stdlib",
    tokenizer: Annotated[str, typer.Option(help="'byte' or a path to a tokenizer.json.")
                         ] = "byte",
    val_percent: Annotated[float, typer.Option(help="Percent of files held out.")] = 2.0,
    if_missing: Annotated[bool, typer.Option(
        "--if-missing", help="Do nothing if OUT already holds a valid prepared set.")] = False,
) -> None:
    """Tokenize text files into memory-mapped shards with a train/val split."""
    from tessera.data.prepare import prepare
    from tessera.data.tokenizer import load_tokenizer

    if if_missing and is_prepared(out):
        print(f"{out}: already prepared")
        return
    if not 0 < val_percent < 100:
        raise fail(f"--val-percent={val_percent}: must be in (0, 100)")
    try:
        tok = load_tokenizer(tokenizer)
        manifest = prepare(source or ["stdlib"], out, tok, val_percent)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None
    counts = {k: sum(s["tokens"] for s in v) for k, v in manifest["splits"].items()}
    print(f"{out}: {counts['train']:,} train and {counts['val']:,} val tokens "
          f"({manifest['tokenizer']} tokenizer, vocab {manifest['vocab_size']})")


def is_prepared(path: str) -> bool:
    from tessera.data.loader import DataError, TokenDataset

    try:
        TokenDataset(path)
    except DataError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="tessera")


if __name__ == "__main__":
    main()
