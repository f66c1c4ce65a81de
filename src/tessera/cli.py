"""The `tessera` command line.

    tessera train [--preset NAME] [--config FILE] [--set section.field=value ...]
                  [--nproc N] [--dp N] [--tp N] [--pp N] [--cp N] ...
    tessera data prepare [--source stdlib|PATH ...] [--out DIR] [--tokenizer byte|FILE]
    tessera config [--preset NAME] [--config FILE] [--set ...]     print the resolved config
    tessera schedule --schedule NAME --pp P --microbatches M [--virtual V] [--out DIR]
    tessera generate --checkpoint DIR [--prompt TEXT] [--tokens N] [--temperature T] ...
    tessera eval --checkpoint DIR [--data DIR] [--seq-len N] [--tokens N]
    tessera export-hf --checkpoint DIR --out DIR          (a Hugging Face Llama directory)
    tessera checkpoint inspect PATH                        (step, layout, tensors, sizes)
    tessera checkpoint export PATH --to DIR [--format hf|torch]   (consolidated weights)

Bad input (a config rule, a missing data path, an unknown preset) prints one line,
``error: <field>=<value>: <rule>``, and exits with code 2, on every rank, before any collective.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import functools
import inspect
import itertools
import os
import re
import sys
import typing
from typing import Annotated

import typer
import yaml
from typer.core import TyperGroup

from tessera.config import (
    ALLREDUCE_ALGORITHMS,
    CP_METHODS,
    DP_MODES,
    INT64_MAX,
    LR_SCALINGS,
    Config,
)
from tessera.config_io import load_file, make_config
from tessera.config_warnings import config_warnings
from tessera.data.cli import data_app
from tessera.errors import ConfigError, UserError, shown
from tessera.pipeline.schedules import SCHEDULES, default_virtual
from tessera.planner.cli import plan_app
from tessera.presets import PRESETS
from tessera.weights_cli import checkpoint_app, eval_cmd, export_hf_cmd, generate_cmd

EXIT_BAD_INPUT = 2


class OneLineErrors(TyperGroup):
    """Bad input as one line, ``error: ...``, exit status 2: a :class:`UserError` any command
    raises, and Click's own usage errors (a flag's value of the wrong type, an unknown flag, a
    flag without its value), around which Click would print the usage and a hint."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except UserError as e:
            if not standalone_mode:
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)
        except OSError as e:
            # A path the kernel refuses by its name (too long), given to any command: the
            # user's input, not a bug. Every other OSError keeps its traceback.
            if not standalone_mode or e.errno != errno.ENAMETOOLONG:
                raise
            print(f"error: {shown(str(e.filename))}: {e.strerror}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)
        except typer.TyperException as e:
            if not standalone_mode:
                raise
            if type(e).__name__ == "NoArgsIsHelpError":  # `tessera` alone: the help text
                print(e.format_message(), file=sys.stderr)
            else:
                print(f"error: {e.format_message()}", file=sys.stderr, flush=True)
            sys.exit(getattr(e, "exit_code", EXIT_BAD_INPUT))
        if not standalone_mode:
            return code
        # Without standalone mode, a command's typer.Exit(code) comes back as its code.
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, cls=OneLineErrors,
                  help="tessera: train transformers across devices.")
app.add_typer(data_app, name="data")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(plan_app, name="plan")

DEFAULT_PRESET = "demo"
RELAUNCHED = "TESSERA_RELAUNCHED"  # set for the ranks `train --nproc` launches


Preset = Annotated[str | None, typer.Option(
    help=f"Named preset: {', '.join(PRESETS)}. Default: the config file's `preset`, else "
         f"{DEFAULT_PRESET}.")]
ConfigFile = Annotated[str | None, typer.Option("--config", help="TOML or YAML config file.")]
Sets = Annotated[list[str] | None, typer.Option(
    "--set", help="Override one field: section.field=value (repeatable).")]


def resolve_config(preset: str | None, config_file: str | None, sets: list[str] | None,
                   flags: dict[str, dict], nproc: int | None = None) -> Config:
    """Preset < file < flags < --set. With --nproc and no explicit --dp, dp fills the world.

    The preset is --preset if given, else the config file's `preset`, else demo."""
    sections = {k: {f: v for f, v in d.items() if v is not None} for k, d in flags.items()}
    if preset is None:
        preset = (load_file(config_file) if config_file else {}).get("preset", DEFAULT_PRESET)
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


TRAIN_FLAGS: dict[str, str] = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
    "cp-method": "parallel.cp_method", "cp-ulysses": "parallel.cp_ulysses",
    "zero-stage": "parallel.zero_stage", "ep": "parallel.ep",
    "moe-experts": "model.moe_experts", "moe-top-k": "model.moe_top_k",
    "moe-capacity-factor": "model.moe_capacity_factor",
    "dp-mode": "parallel.dp_mode", "bucket-mb": "parallel.bucket_mb",
    "allreduce-algorithm": "parallel.allreduce_algorithm",
    "max-staleness": "parallel.max_staleness", "sequence-parallel": "parallel.sequence_parallel",
    "scatter-gather": "parallel.scatter_gather",
    "schedule": "parallel.schedule", "microbatches": "train.grad_accum",
    "virtual": "parallel.virtual_stages", "microbatch-group": "parallel.microbatch_group",
    "stage-layout": "parallel.stage_layout", "recompute": "parallel.recompute",
    "steps": "train.steps", "micro-batch-size": "train.micro_batch_size",
    "precision": "train.precision", "peak-tflops": "train.peak_tflops",
    "checkpoint-interval": "train.checkpoint_interval", "resume": "train.resume",
    "overwrite": "train.overwrite", "init-from": "train.init_from",
    "profile-steps": "train.profile_steps", "tensorboard": "train.tensorboard",
    "memory-snapshot": "train.memory_snapshot",
    "collective-timeout": "train.collective_timeout_s",
    "loss-chunk-tokens": "train.loss_chunk_tokens", "compile": "train.compile",
    "lr-scaling": "train.lr_scaling", "reference-batch": "train.reference_batch",
    "noise-scale": "train.noise_scale",
    "data": "data.path", "out": "train.out_dir",
}
"""`tessera train`'s config flags: flag name -> the config field it sets. A flag takes its
field's type (a bool field's flag has a --no- form unless it is in ONE_WAY_FLAGS) and its help
is the first sentence of the field's docstring."""
ONE_WAY_FLAGS = {"overwrite"}
CHOICES = {"parallel.schedule": SCHEDULES, "parallel.dp_mode": DP_MODES,
           "parallel.cp_method": CP_METHODS, "parallel.allreduce_algorithm": ALLREDUCE_ALGORITHMS,
           "train.lr_scaling": LR_SCALINGS}
"""Fields whose value names an entry of a registry: their flag's help lists the names."""


@functools.cache
def field_docs() -> dict[str, str]:
    """'Class.field' -> the docstring written under the field in tessera.config's source."""
    import tessera.config

    docs = {}
    classes = [n for n in ast.parse(inspect.getsource(tessera.config)).body
               if isinstance(n, ast.ClassDef)]
    for cls in classes:
        for field, doc in itertools.pairwise(cls.body):
            if (isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)):
                docs[f"{cls.name}.{field.target.id}"] = doc.value.value
    return docs


def config_option(flag: str, dotted: str) -> inspect.Parameter:
    """The parameter typer makes `--flag` of: the field's type or None (not given), and help
    from the first sentence of its docstring, the registry's names and the field's name."""
    section, name = dotted.split(".")
    section_class = typing.get_type_hints(Config)[section]
    annotation = next(f.type for f in dataclasses.fields(section_class) if f.name == name)
    kind = next(t for t in (bool, int, float, str) if t.__name__ in annotation.split(" | "))
    doc = " ".join(field_docs()[f"{section_class.__name__}.{name}"].replace("``", "").split())
    first = re.split(r"(?<=\.)\s+(?=[A-Z])", doc, maxsplit=1)[0]
    choices = f" Choices: {', '.join(CHOICES[dotted])}." if dotted in CHOICES else ""
    decls = [f"--{flag}"] if flag in ONE_WAY_FLAGS else []  # else typer's --flag/--no-flag
    option = typer.Option(*decls, help=f"{first}{choices} ({dotted})")
    return inspect.Parameter(flag.replace("-", "_"), inspect.Parameter.KEYWORD_ONLY,
                             default=None, annotation=Annotated[kind | None, option])


def with_config_options(command):
    """`command`, which takes **config_flags, with a keyword parameter for each TRAIN_FLAGS."""
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD] + [
        config_option(flag, dotted) for flag, dotted in TRAIN_FLAGS.items()]
    command.__signature__ = signature.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}  # typer reads both
    return command


@app.command()
@with_config_options
def train(
    preset: Preset = None,
    config: ConfigFile = None,
    set_: Sets = None,
    nproc: Annotated[int | None, typer.Option(
        help="Ranks to launch on this machine (torch's elastic launcher); "
             "default dp*tp*pp*cp.")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        help="Restart all ranks up to N times when one fails (the elastic launcher's "
             "--max-restarts); a restarted job resumes from the newest complete checkpoint.")
    ] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check everything (config, layout, data, resume checkpoint, memory "
                          "per rank) and print the resolved config, the memory estimate and "
                          "the warnings; start nothing.")] = False,
    **config_flags: object,
) -> None:
    """Train a model; launches --nproc ranks itself unless already under torchrun."""
    flags: dict[str, dict] = {}
    for name, value in config_flags.items():
        section, field = TRAIN_FLAGS[name.replace("_", "-")].split(".")
        flags.setdefault(section, {})[field] = value
    from tessera.preflight import check_run, report_lines
    from tessera.run_dir import begin_out_dir

    under_launcher = "RANK" in os.environ
    if nproc is not None and nproc < 1:
        raise ConfigError("--nproc", nproc, "must be >= 1")
    # Under a launcher the world is known; dp fills it unless given, as with --nproc.
    world_hint = int(os.environ["WORLD_SIZE"]) if under_launcher else nproc
    cfg = resolve_config(preset, config, set_, flags, world_hint)
    cfg = model_from_weights(cfg) if cfg.train.init_from else vocab_from_data(cfg, config, set_)
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else (
        nproc or cfg.parallel.world_size)
    check_max_restarts(max_restarts, under_launcher)
    defaulted_out = not cfg.train.out_dir
    # A rank this command launched skips the memory check: its launcher made it.
    checked = check_run(cfg, world, "cuda" if torch_cuda_available() else "cpu",
                        memory=RELAUNCHED not in os.environ)
    if dry_run:
        print("\n".join(report_lines(checked, "tessera train --dry-run")))
        return
    cfg, origin = checked.cfg, checked.start
    if checked.new_out:  # every check passed: the new directory is made (once) and linked
        cfg = begin_out_dir(cfg)
    if not under_launcher or (os.environ["RANK"] == "0" and RELAUNCHED not in os.environ):
        for line in config_warnings(cfg):  # once: by us before a relaunch, else by rank 0
            print(f"warning: {line}", file=sys.stderr, flush=True)

    if not under_launcher and (world > 1 or max_restarts):
        from tessera.launch import launch
        from tessera.run_dir import RUN_ID_ENV, out_dir_override

        argv = train_args(sys.argv[1:])
        for option in ("--nproc", "--max-restarts"):
            argv = strip_option(argv, option)
        if defaulted_out:  # the ranks and their restarts write where this process chose
            argv += out_dir_override(cfg.train.out_dir)
        # The ranks inherit these: they do not warn again, and hold this run's id (restarts too).
        before = {name: os.environ.get(name) for name in (RELAUNCHED, RUN_ID_ENV)}
        os.environ.update({RELAUNCHED: "1", RUN_ID_ENV: origin.run_id})
        try:
            code = launch(world, argv, max_restarts or 0)
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        raise typer.Exit(code)

    from tessera.trainer import PeerLostError, run

    try:
        run(cfg, progress=not no_progress)
    except PeerLostError as e:  # not bad input: exit 1, as a failed rank does
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None


def torch_cuda_available() -> bool:
    """Whether the ranks will train on GPUs (trainer.pick_device's rule)."""
    import torch

    return torch.cuda.is_available()
def check_max_restarts(max_restarts: int | None, under_launcher: bool) -> None:
    if max_restarts is None:
        return
    if not 0 <= max_restarts <= INT64_MAX:
        raise ConfigError("--max-restarts", max_restarts, f"must be >= 0 and <= {INT64_MAX}")
    if under_launcher:
        raise ConfigError("--max-restarts", max_restarts, "is the launcher's: under torchrun, "
                          "give it to torchrun (torchrun --max-restarts N -m tessera.train ...)")


def model_from_weights(cfg: Config) -> Config:
    """With train.init_from, the model section is the weights' own."""
    from tessera.hf import HFError
    from tessera.weights import weights_config

    try:
        model = weights_config(cfg.train.init_from)
    except HFError as e:
        raise ConfigError("train.init_from", cfg.train.init_from, str(e)) from None
    return dataclasses.replace(cfg, model=model)


def vocab_from_data(cfg: Config, config_file: str | None, sets: list[str] | None) -> Config:
    """The model's vocabulary is the prepared data's tokenizer's, unless the config file or a
    --set names model.vocab_size (then check_data holds the two to agreement)."""
    from tessera.data.loader import DataError, TokenDataset

    in_file = "vocab_size" in (load_file(config_file).get("model") or {}) if config_file else False
    if in_file or any(s.replace(" ", "").startswith("model.vocab_size=") for s in sets or []):
        return cfg
    try:
        vocab = TokenDataset(cfg.data.path, verify=False).vocab_size
    except DataError:
        return cfg  # check_data says what is wrong with the data
    if vocab == cfg.model.vocab_size:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def train_args(argv: list[str]) -> list[str]:
    """The arguments after the `train` command word; a later `train` (`--out train`) stays."""
    return argv[argv.index("train") + 1:]


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
        help=f"Pipeline schedule: {', '.join(SCHEDULES)}.")] = "1f1b",
    pp: Annotated[int, typer.Option(help="Pipeline ranks.")] = 4,
    microbatches: Annotated[int, typer.Option(help="Micro-batches per step.")] = 8,
    virtual: Annotated[int, typer.Option(
        help="Chunks per rank (interleaved, bfs; zb-v and dualpipev run 2); 0: the "
             "schedule's default.")] = 0,
    microbatch_group: Annotated[int, typer.Option(
        help="Interleaved: micro-batches per chunk visit (0: pp, Megatron's default).")] = 0,
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

    if backward_ratio <= 0:
        raise ConfigError("--backward-ratio", backward_ratio, "must be > 0")
    for flag, value in (("--dp-reduce", dp_reduce), ("--gather", gather)):
        if value < 0:
            raise ConfigError(flag, value, "must be >= 0")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError("--zero-stage", zero_stage, "must be 0, 1, 2 or 3")
    if gather and zero_stage != 3:
        raise ConfigError("--gather", gather, "parameter all-gathers need --zero-stage 3")
    virtual = virtual or default_virtual(schedule)
    least = SCHEDULES[schedule].min_virtual if schedule in SCHEDULES else 1
    if virtual < least and file is None:
        raise ConfigError("--virtual", virtual, f"{schedule} needs --virtual >= {least} "
                          "(with one chunk per rank it is plain 1f1b)")
    print(describe(load_schedule(schedule, pp, microbatches, virtual, file,
                                 microbatch_group),
                   backward_ratio, dp_reduce, out, zero_stage, gather, microbatch_group))


@app.command("config")
def show_config(
    preset: Preset = None, config: ConfigFile = None, set_: Sets = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Also check the config as `train --dry-run` does, for dp*tp*pp*cp "
                        "ranks: layout, data (if data.path exists), resume checkpoint, memory "
                        "per rank; print the memory estimate and the warnings.")] = False,
) -> None:
    """Print the resolved configuration as YAML (exit 2 with one line if --check fails)."""
    cfg = resolve_config(preset, config, set_, {})
    if not check:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return
    from tessera.preflight import check_run, report_lines

    # As train does, with the data checked only where it exists.
    cfg = model_from_weights(cfg) if cfg.train.init_from else vocab_from_data(cfg, config, set_)
    checked = check_run(cfg, cfg.parallel.world_size,
                        "cuda" if torch_cuda_available() else "cpu", data=False)
    print("\n".join(report_lines(checked, "tessera config --check")))


app.command("generate")(generate_cmd)
app.command("export-hf")(export_hf_cmd)
app.command("eval")(eval_cmd)


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="tessera")


if __name__ == "__main__":
    main()
