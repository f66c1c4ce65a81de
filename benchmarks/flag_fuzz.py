"""Random `tessera train` flag sets through the real command line, checked with `--dry-run`, and
the accepted edge cases launched for real.

    python benchmarks/flag_fuzz.py [--cases 1000] [--seed 0] [--launch] [--out FILE]

Each case is the tiny preset on a small generated corpus plus one to five flags drawn at random
from every option `tessera train` has (read from the command itself, so a new flag is fuzzed
without editing this file), with values from pools: ordinary, boundary (0, 1, int64's edges),
huge (2^63, 10^20, 76 and 5,000 digits), negative, NaN/infinity, wrong type, unknown flags and
`--set` fields, config files holding huge integers, and layouts that conflict.

Each case runs `tessera train ... --dry-run` in a process of its own (forked from this one, so
the exit status and stderr are the operating system's) with a 30 s limit. The contract:

- exit 0 (accepted) with no traceback, or
- exit 2 with exactly one line on stderr that starts with ``error: `` (refused);
- anything else (a traceback, another exit status, several lines, a hang) is a finding.

With ``--launch``, every accepted case that holds an edge value (boundary, huge or extreme) is
then run for real, without ``--dry-run``, at most 3 optimizer steps (``--set train.steps=3``
appended), with a 240 s limit: it must end, or be refused before it starts.

The counts per category go to stdout and, with ``--out``, to a JSON file beside the text.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
import typing
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

DRY_RUN_LIMIT_S = 30.0
LAUNCH_LIMIT_S = 240.0
LAUNCH_STEPS = 3
BASE = ["train", "--preset", "tiny", "--data", "{data}", "--out", "{dir}/out", "--no-progress"]

INT64_MAX = 2**63 - 1
TAME_SHARE = 0.6
"""The chance that a drawn value comes from the tame half of its pool (ordinary, boundary)."""


@dataclass
class Case:
    argv: list[str]
    kinds: set[str] = field(default_factory=set)
    """What the values are: ordinary, boundary, huge, negative, nonfinite, wrong-type, unknown,
    conflicting, file."""
    files: dict[str, str] = field(default_factory=dict)

    @property
    def category(self) -> str:
        """The most hostile kind in the case names its category."""
        for kind in ("unknown", "wrong-type", "nonfinite", "huge", "negative", "file",
                     "conflicting", "boundary"):
            if kind in self.kinds:
                return kind
        return "ordinary"

    @property
    def edge(self) -> bool:
        return bool(self.kinds & {"boundary", "huge", "nonfinite", "negative", "conflicting"})

    def resolve(self, directory: str, data: str) -> list[str]:
        return [a.replace("{dir}", directory).replace("{data}", data) for a in self.argv]


# ---------------------------------------------------------------------------------------------
# Value pools by the option's type


INT_VALUES: list[tuple[str, str]] = [
    ("ordinary", "1"), ("ordinary", "2"), ("ordinary", "4"), ("ordinary", "3"),
    ("boundary", "0"), ("boundary", str(INT64_MAX)), ("boundary", "8"), ("boundary", "16"),
    ("boundary", "64"), ("boundary", "1000"),
    ("huge", str(2**63)), ("huge", str(10**20)), ("huge", "9" * 76), ("huge", "10000000"),
    ("negative", "-1"), ("negative", str(-2**63)), ("negative", "-99999999999999999999"),
    ("wrong-type", "abc"), ("wrong-type", "1.5"), ("wrong-type", "nan"), ("wrong-type", ""),
    ("wrong-type", "1e3"), ("wrong-type", "0x10"),
]
FLOAT_VALUES: list[tuple[str, str]] = [
    ("ordinary", "0.5"), ("ordinary", "1"), ("ordinary", "25"), ("ordinary", "2.5"),
    ("boundary", "0"), ("boundary", "1e-300"), ("boundary", "1e300"), ("boundary", "5e-324"),
    ("huge", "1e400"), ("huge", "9" * 400),
    ("negative", "-1"), ("negative", "-1e300"),
    ("nonfinite", "nan"), ("nonfinite", "inf"), ("nonfinite", "-inf"),
    ("wrong-type", "abc"), ("wrong-type", ""), ("wrong-type", "1,5"),
]
STR_VALUES: list[tuple[str, str]] = [
    ("wrong-type", ""), ("wrong-type", "zigzag"), ("wrong-type", "x" * 5000),
    ("wrong-type", "../../etc/passwd"), ("wrong-type", "1F1B"), ("wrong-type", "ümlaut"),
]
# Legal values of the string options, so most cases get past the first refusal.
CHOICES: dict[str, list[str]] = {
    "cp_method": ["ring", "allgather", "ulysses", "hybrid"],
    "dp_mode": ["allreduce", "ps", "ps-async"],
    "allreduce_algorithm": ["backend", "auto", "naive", "parallel", "ring", "rabenseifner"],
    "schedule": ["naive", "gpipe", "1f1b", "interleaved", "interleaved-lean", "bfs"],
    "recompute": ["none", "selective", "full"],
    "precision": ["fp32", "bf16"],
    "preset": ["tiny", "demo", "moe-demo", "gpt2-124m", "llama-1b"],
    "stage_layout": ["1,1", "2", "1*2", "Et|tL", "0,2", "3*9"],
    "profile_steps": ["1:1", "1:2", "2:9", "0:1"],
    "resume": ["latest", "{dir}/none"],
    "init_from": ["{dir}/none"],
    "config": ["{dir}/none.yaml"],
    "data": ["{dir}/none", "{dir}"],
}
# Options the fuzz leaves to BASE or to its own channels.
SKIP = {"no_progress", "out", "set_", "data", "config", "dry_run"}
# Fields through --set, with the pools of their annotation.
SET_EXTRA: list[tuple[str, str]] = [
    ("huge", "9" * 5000), ("huge", str(10**30)), ("huge", "1e400"), ("nonfinite", ".nan"),
    ("nonfinite", ".inf"), ("wrong-type", "[1, 2]"), ("wrong-type", "{a: 1}"),
    ("wrong-type", "yes"), ("wrong-type", "null"),
]


def _options() -> dict[str, tuple[str, str]]:
    """name -> (flag, kind: int, float, str, bool) for every `tessera train` option."""
    import typer.main

    from tessera.cli import app, train

    hints = typing.get_type_hints(train, include_extras=False)
    command = typer.main.get_command(app).commands["train"]
    out = {}
    for param in command.params:
        if param.name in SKIP:
            continue
        kinds = {a.__name__ for a in typing.get_args(hints[param.name])} or {
            hints[param.name].__name__}
        kind = next(k for k in ("bool", "int", "float", "str") if k in kinds)
        out[param.name] = (param.opts[0], kind, param.secondary_opts)
    return out


def _set_fields() -> list[tuple[str, str, str]]:
    from tessera.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

    sections = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                "data": DataConfig}
    return [(s, f.name, str(f.type)) for s, cls in sections.items() for f in fields(cls)
            if (s, f.name) not in {("data", "path"), ("train", "out_dir")}]


def _flag(rng: random.Random, name: str, option: tuple) -> tuple[list[str], str]:
    flag, kind, negative_opts = option
    if kind == "bool":
        if negative_opts and rng.random() < 0.5:
            return [negative_opts[0]], "ordinary"
        return [flag], "ordinary"
    if name in CHOICES and rng.random() < 0.75:
        value = rng.choice(CHOICES[name])
        return [flag, value], "file" if "{dir}" in value else "ordinary"
    pool = {"int": INT_VALUES, "float": FLOAT_VALUES}.get(kind, STR_VALUES)
    what, value = _pick(rng, pool)
    return [flag, value], what


def _pick(rng: random.Random, pool: list[tuple[str, str]]) -> tuple[str, str]:
    """Half the draws from the pool's ordinary and boundary values, half from the rest, so
    enough cases pass every check to be launched."""
    tame = [v for v in pool if v[0] in ("ordinary", "boundary")]
    return rng.choice(tame if tame and rng.random() < TAME_SHARE else pool)


def _set(rng: random.Random, set_fields) -> tuple[list[str], str]:
    section, name, annotation = rng.choice(set_fields)
    if rng.random() < 0.3:
        what, value = rng.choice(SET_EXTRA)
    elif "int" in annotation:
        what, value = _pick(rng, INT_VALUES)
    elif "float" in annotation:
        what, value = _pick(rng, FLOAT_VALUES)
    elif "bool" in annotation:
        what, value = rng.choice([("ordinary", "true"), ("ordinary", "false"),
                                  ("wrong-type", "2")])
    else:
        what, value = rng.choice(STR_VALUES)
    if what == "wrong-type" and value == "":
        value = "''"
    return ["--set", f"{section}.{name}={value}"], what


def _unknown(rng: random.Random, options) -> tuple[list[str], str]:
    roll = rng.random()
    if roll < 0.4:
        flag = rng.choice([o[0] for o in options.values()])
        return [flag.rstrip("s") + "x", "1"], "unknown"
    if roll < 0.7:
        section, name, _ = rng.choice(_set_fields())
        return ["--set", f"{section}.{name}_typo=1"], "unknown"
    return ["--set", f"{rng.choice(['models', 'para', 'x'])}.dp=1"], "unknown"


def _config_file(rng: random.Random, case: Case) -> None:
    """A config file holding a huge or hostile value."""
    section, name, annotation = rng.choice(_set_fields())
    value = rng.choice(["9" * 5000, str(2**64), "-" + "9" * 30, "1e999", "nan"])
    ext = rng.choice(["toml", "yaml"])
    text = f"[{section}]\n{name} = {value}\n" if ext == "toml" else (
        f"{section}:\n  {name}: {value}\n")
    case.files[f"run.{ext}"] = text
    case.argv += ["--config", f"{{dir}}/run.{ext}"]
    case.kinds.add("huge" if value[-1].isdigit() else "file")


LAYOUT = ["--dp", "--tp", "--pp", "--cp", "--ep", "--nproc", "--virtual", "--zero-stage",
          "--microbatches"]


def draw(rng: random.Random, options, set_fields) -> Case:
    case = Case(list(BASE))
    if rng.random() < 0.1:  # the default preset (demo: 2 ranks, 4 layers)
        i = case.argv.index("--preset")
        del case.argv[i:i + 2]
    for _ in range(rng.randint(1, 5)):
        roll = rng.random()
        if roll < 0.65:
            name = rng.choice(sorted(options))
            argv, what = _flag(rng, name, options[name])
        elif roll < 0.85:
            argv, what = _set(rng, set_fields)
        elif roll < 0.94:
            argv, what = _unknown(rng, options)
        else:
            _config_file(rng, case)
            continue
        case.argv += argv
        case.kinds.add(what)
    if sum(a in LAYOUT for a in case.argv) >= 2:
        case.kinds.add("conflicting")
    return case


def draw_cases(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    options, set_fields = _options(), _set_fields()
    return [draw(rng, options, set_fields) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Running a case


def _child(argv: list[str], err_path: str) -> None:
    """The forked process: `tessera *argv` with stdout dropped and stderr to a file."""
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(err, 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    from tessera.cli import main

    main(argv)


def preload() -> None:
    """Import what a dry run imports, once, before forking: each case then pays for its own
    checks only (5x faster here)."""
    import tessera.cli  # noqa: F401
    import tessera.planner.engine  # noqa: F401
    import tessera.planner.moe  # noqa: F401
    import tessera.planner.search  # noqa: F401
    import tessera.preflight  # noqa: F401
    import tessera.trainer  # noqa: F401


def dry_run(case: Case, data: str) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="tessera-flagfuzz-"))
    for name, text in case.files.items():
        (scratch / name).write_text(text)
    argv = [*case.resolve(str(scratch), data), "--dry-run"]
    err_path = scratch / "stderr"
    proc = mp.get_context("fork").Process(target=_child, args=(argv, str(err_path)))
    t0 = time.perf_counter()
    proc.start()
    proc.join(DRY_RUN_LIMIT_S)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    seconds = time.perf_counter() - t0
    stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    started = (scratch / "out").exists()
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    return judge(argv, proc.exitcode, stderr, hung, seconds, started)


def shown(argv: list[str]) -> str:
    """The command line as the record shows it: a long argument cut to 60 characters with its
    length (a 5,000-character path would bury the rest)."""
    return " ".join(a if len(a) <= 60 else f"{a[:40]}...<{len(a)} chars>" for a in argv)


def judge(argv, code, stderr: str, hung: bool, seconds: float, started: bool = False) -> dict:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if hung:
        verdict = "hang"
    elif "Traceback" in stderr:
        verdict = "traceback"
    elif code == 0:
        verdict = "accepted"
    elif code == 2 and len(errors) == 1 and all(
            ln.startswith(("error: ", "warning: ")) for ln in lines):
        verdict = "refused"
    else:
        verdict = "bad-exit"
    if verdict in ("accepted", "refused") and started:
        verdict = "wrote-output"  # a dry run must not start the run
    return {"argv": shown(argv), "exit": code, "verdict": verdict, "seconds": round(seconds, 2),
            "error": errors[0][:300] if errors else "",
            "stderr_tail": "\n".join(ln[:300] for ln in stderr[-3000:].splitlines()[-12:])}


def launch(case: Case, data: str, python: str) -> dict:
    """The case for real, at most LAUNCH_STEPS steps, in a process of its own."""
    scratch = Path(tempfile.mkdtemp(prefix="tessera-flaglaunch-"))
    for name, text in case.files.items():
        (scratch / name).write_text(text)
    argv = [*case.resolve(str(scratch), data), "--set", f"train.steps={LAUNCH_STEPS}"]
    t0 = time.perf_counter()
    try:
        done = subprocess.run([python, "-m", "tessera.cli", *argv], capture_output=True,
                              text=True, timeout=LAUNCH_LIMIT_S)
        code, stderr, hung = done.returncode, done.stderr, False
    except subprocess.TimeoutExpired as e:
        code, stderr, hung = None, (e.stderr or b"").decode(errors="replace") if isinstance(
            e.stderr, bytes) else (e.stderr or ""), True
    seconds = time.perf_counter() - t0
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    result = judge(argv, code, stderr, hung, seconds)
    if result["verdict"] == "accepted":
        result["verdict"] = "trained"
    return result


# ---------------------------------------------------------------------------------------------


def make_corpus(directory: Path) -> str:
    """A small prepared byte-level corpus (~60 KB), as the tests' tiny_data."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import SAMPLE_TEXT
    from tessera.data.prepare import prepare
    from tessera.data.tokenizer import ByteTokenizer

    src = directory / "src"
    src.mkdir(parents=True)
    for i in range(40):
        (src / f"mod_{i:02d}.py").write_text(SAMPLE_TEXT.replace("fibonacci", f"fib_{i}") * 4)
    out = directory / "tiny"
    prepare([str(src)], out, ByteTokenizer(), val_percent=20.0)
    return str(out)


def summarize(results: list[dict], cases: list[Case]) -> dict:
    per_category: dict[str, Counter] = defaultdict(Counter)
    for case, r in zip(cases, results, strict=True):
        per_category[case.category][r["verdict"]] += 1
    return {cat: dict(c) for cat, c in sorted(per_category.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # forked children must not inherit OpenMP workers
    preload()
    data = make_corpus(Path(tempfile.mkdtemp(prefix="tessera-flagfuzz-data-")))
    cases = draw_cases(args.seed, args.cases)
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        results.append(dry_run(case, data))
        if results[-1]["verdict"] not in ("accepted", "refused"):
            print(f"[{i}] {results[-1]['verdict']}: {results[-1]['argv']}\n"
                  f"{results[-1]['stderr_tail']}", flush=True)
    dry_s = time.perf_counter() - t0
    verdicts = Counter(r["verdict"] for r in results)
    report = {"cases": len(cases), "seed": args.seed, "dry_run_limit_s": DRY_RUN_LIMIT_S,
              "verdicts": dict(verdicts), "per_category": summarize(results, cases),
              "slowest_dry_run_s": max(r["seconds"] for r in results),
              "dry_run_wall_s": round(dry_s, 1),
              "findings": [r for r in results if r["verdict"] not in ("accepted", "refused")]}
    print(f"dry runs: {len(cases)} cases in {dry_s:.0f} s: {dict(verdicts)}")
    for cat, counts in report["per_category"].items():
        print(f"  {cat:12s} {counts}")
    if args.launch:
        edge = [(c, r) for c, r in zip(cases, results, strict=True)
                if r["verdict"] == "accepted" and c.edge]
        python = sys.executable
        launched = []
        for i, (case, _) in enumerate(edge):
            r = launch(case, data, python)
            launched.append(r)
            print(f"launch {i + 1}/{len(edge)}: {r['verdict']} in {r['seconds']:.0f} s: "
                  f"{r['argv'].split(' --no-progress ')[-1]}", flush=True)
            if r["verdict"] not in ("trained", "refused"):
                print(r["stderr_tail"], flush=True)
        report["launches"] = {"cases": len(edge), "steps": LAUNCH_STEPS,
                              "limit_s": LAUNCH_LIMIT_S,
                              "verdicts": dict(Counter(r["verdict"] for r in launched)),
                              "slowest_s": max((r["seconds"] for r in launched), default=0.0),
                              "runs": [{k: r[k] for k in ("argv", "verdict", "seconds",
                                                          "error")} for r in launched]}
        print(f"launches: {len(edge)} accepted edge cases: {report['launches']['verdicts']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    bad = [r for r in results if r["verdict"] not in ("accepted", "refused")]
    bad += [r for r in report.get("launches", {}).get("runs", [])
            if r["verdict"] not in ("trained", "refused")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
