"""Invalid `tessera train` inputs, generated from a seed: each must end in one line
``error: ...`` on stderr, exit status 2 and no traceback (the CLI's bad-input contract).

``cases(seed, n)`` draws `n` cases, deterministically from `seed`, round-robin over the
categories below; each category makes its case invalid by construction:

- ``type``: a field given a value of the wrong type (read from the field's annotation, so new
  fields are covered), through ``--set``, a TOML file or a YAML file;
- ``range``: a value outside its field's rule (non-positive sizes, probabilities outside
  [0, 1], NaN and infinity in any float, unknown names of schedules, modes, methods);
- ``combination``: fields legal alone that break a rule together (tp not dividing the heads,
  pp·v above the layers, ZeRO with the parameter server, ...);
- ``unknown``: a misspelt section or field;
- ``file``: malformed TOML or YAML, an empty YAML file, a top level that is not a table, bytes
  that are not UTF-8, a YAML tag that would build a Python object, a missing file;
- ``flag``: a command-line flag with a value of the wrong type or out of range, an unknown flag,
  a malformed ``--set``, a missing data directory or checkpoint;
- ``huge``: an integer beyond int64 (20 and 76 digits), one of 5,000 digits (past Python's
  4,300-digit limit on reading integers) or above a field's sensible maximum
  (``tessera.config.LIMITS``), in any integer or float field, through ``--set``, a TOML or a
  YAML file; and sizes the data or the schedule cannot hold (a pipeline of ten million
  micro-batches, a global batch larger than the train split).

A case is ``Case(label, argv, files)``: `argv` after ``tessera``, with ``{dir}`` (a scratch
directory holding `files`) and ``{data}`` (a prepared data set) still to fill in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields

from tessera.config import (
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)

SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
            "data": DataConfig}
BASE = ["train", "--preset", "tiny", "--data", "{data}", "--out", "{dir}/out", "--no-progress"]


@dataclass
class Case:
    label: str
    argv: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)
    category: str = ""

    def resolve(self, directory: str, data: str) -> list[str]:
        return [a.replace("{dir}", directory).replace("{data}", data) for a in self.argv]


# ---------------------------------------------------------------------------------------------
# Values and how each channel writes them


class Digits(str):
    """An integer written out as its digits: one too long for Python to read or print (more
    than 4,300 digits) is written as it is in every channel."""


def _toml(value) -> str:
    if isinstance(value, Digits):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _yaml(value) -> str:
    if isinstance(value, Digits):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _set_text(value) -> str:
    """How --set spells `value` (read back with int, float, then YAML)."""
    if isinstance(value, str):
        return value
    return _yaml(value)


def _through(rng: random.Random, label: str, values: dict[str, dict]) -> Case:
    """`values` ({section: {field: value}}) given through --set, a TOML or a YAML file."""
    channel = rng.choice(["set", "toml", "yaml"])
    if channel == "set" and all(not isinstance(v, str) or v for s in values.values()
                                for v in s.values()):
        argv = list(BASE)
        for section, items in values.items():
            for name, value in items.items():
                argv += ["--set", f"{section}.{name}={_set_text(value)}"]
        return Case(f"{label} (--set)", argv)
    if channel == "yaml":
        text = "".join(f"{s}:\n" + "".join(f"  {k}: {_yaml(v)}\n" for k, v in items.items())
                       for s, items in values.items())
        return Case(f"{label} (yaml)", [*BASE, "--config", "{dir}/run.yaml"],
                    {"run.yaml": text})
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in items.items())
                   for s, items in values.items())
    return Case(f"{label} (toml)", [*BASE, "--config", "{dir}/run.toml"], {"run.toml": text})


# ---------------------------------------------------------------------------------------------
# Categories


# BASE's own flags set these, and flags beat a config file.
SET_BY_BASE = {("data", "path"), ("train", "out_dir")}


def _all_fields() -> list[tuple[str, str, str]]:
    return [(section, f.name, str(f.type)) for section, cls in SECTIONS.items()
            for f in fields(cls) if (section, f.name) not in SET_BY_BASE]


def _wrong_values(annotation: str) -> list:
    kinds = {k.strip() for k in annotation.split("|")}
    out: list = [[1, 2], {"a": 1}]
    if "bool" in kinds:
        return out + ["maybe", 1, 0.5]  # not "yes": YAML 1.1 reads it as true
    if "str" not in kinds:
        out += ["abc", "12abc"]
    if "int" not in kinds and "float" not in kinds:
        out += [7, 2.5]
    elif "float" not in kinds:
        out += [1.5, -0.5]
    if "bool" not in kinds:
        out.append(True)
    return out


def wrong_type(rng: random.Random) -> Case:
    section, name, annotation = rng.choice(_all_fields())
    value = rng.choice(_wrong_values(annotation))
    return _through(rng, f"type: {section}.{name}={value!r} ({annotation})",
                    {section: {name: value}})


def _floats() -> list[tuple[str, str]]:
    return [(s, n) for s, n, a in _all_fields() if "float" in a]


# Values each field's own rule refuses.
OUT_OF_RANGE: dict[tuple[str, str], list] = {
    **{("model", n): [0, -1, -64] for n in ("vocab_size", "d_model", "n_layers", "n_heads",
                                            "max_seq_len")},
    ("model", "n_kv_heads"): [0, -2, 3],
    ("model", "ffn_hidden"): [0, -32],
    ("model", "rope_theta"): [0.0, -10000.0],
    ("model", "norm_eps"): [0.0, -1e-5],
    ("model", "init_std"): [0.0, -0.02],
    **{("parallel", n): [0, -1] for n in ("dp", "tp", "pp", "cp", "ep", "virtual_stages",
                                          "max_staleness")},
    ("parallel", "zero_stage"): [4, -1, 7],
    ("parallel", "dp_mode"): ["", "sync", "ALLREDUCE", "ps_async"],
    ("parallel", "schedule"): ["", "zigzag", "1F1B", "pipedream"],
    ("parallel", "cp_method"): ["", "rings", "Ulysses"],
    ("parallel", "allreduce_algorithm"): ["", "tree", "Ring"],
    ("parallel", "recompute"): ["", "all", "Full"],
    ("parallel", "bucket_mb"): [0.0, -25.0],
    ("train", "steps"): [0, -5],
    ("train", "micro_batch_size"): [0, -8],
    ("train", "grad_accum"): [0, -1],
    ("train", "lr"): [0.0, -3e-3],
    ("train", "min_lr_ratio"): [-0.1, 1.5],
    ("train", "warmup_steps"): [-1],
    ("train", "lr_scaling"): ["", "cubic", "Linear"],
    ("train", "reference_batch"): [-1, -64],
    ("train", "weight_decay"): [-0.1],
    ("train", "beta1"): [1.0, -0.1, 1.5],
    ("train", "beta2"): [1.0, -0.5],
    ("train", "grad_clip"): [-1.0],
    ("train", "precision"): ["", "fp16", "fp8", "BF16"],
    ("train", "eval_interval"): [-1],
    ("train", "log_interval"): [0, -10],
    ("train", "sample_tokens"): [-1],
    ("train", "peak_tflops"): [0.0, -1.0],
    ("train", "checkpoint_interval"): [-1],
    ("train", "keep_checkpoints"): [-1],
    ("train", "profile_steps"): ["5", "a:b", "3-4", "0:2", "4:2", "1:999", ":"],
    ("train", "collective_timeout_s"): [0.0, 0.5, -300.0, 1e7],
    ("data", "seq_len"): [0, -16],
    ("data", "val_tokens"): [0, -1],
}


def out_of_range(rng: random.Random) -> Case:
    if rng.random() < 0.25:  # NaN or infinity in any float field
        section, name = rng.choice(_floats())
        value = rng.choice([math.nan, math.inf, -math.inf])
    else:
        (section, name), values = rng.choice(sorted(OUT_OF_RANGE.items()))
        value = rng.choice(values)
    return _through(rng, f"range: {section}.{name}={value!r}", {section: {name: value}})


# Each breaks a rule between fields of the tiny preset (d_model 64, 4 heads, 2 kv heads,
# 2 layers, seq_len 32, max_seq_len 64).
COMBINATIONS: list[tuple[str, dict]] = [
    ("tp does not divide heads", {"parallel": {"tp": 3}}),
    ("tp above the heads", {"parallel": {"tp": 8}}),
    ("kv heads do not divide heads", {"model": {"n_kv_heads": 3}}),
    ("d_model not divisible by heads", {"model": {"d_model": 66}}),
    ("odd head size", {"model": {"d_model": 12}}),
    ("pp above the layers", {"parallel": {"pp": 4}}),
    ("pp*v above the layers", {"parallel": {"pp": 2, "virtual_stages": 2,
                                            "schedule": "interleaved"},
                               "train": {"grad_accum": 4}}),
    ("virtual stages without a looping schedule", {"parallel": {"virtual_stages": 2}}),
    ("interleaved with one chunk", {"parallel": {"pp": 2, "schedule": "interleaved"},
                                    "train": {"grad_accum": 2}}),
    ("interleaved micro-batches not a multiple of pp",
     {"model": {"n_layers": 4}, "parallel": {"pp": 2, "virtual_stages": 2,
                                             "schedule": "interleaved"},
      "train": {"grad_accum": 3}}),
    ("ZeRO with the parameter server", {"parallel": {"dp": 2, "dp_mode": "ps",
                                                     "zero_stage": 1}}),
    ("parameter server on one rank", {"parallel": {"dp_mode": "ps"}}),
    ("parameter server with tp", {"parallel": {"dp": 2, "tp": 2, "dp_mode": "ps"}}),
    ("parameter server with pp", {"parallel": {"dp": 2, "pp": 2, "dp_mode": "ps"}}),
    ("parameter server in bf16", {"parallel": {"dp": 2, "dp_mode": "ps"},
                                  "train": {"precision": "bf16"}}),
    ("asynchronous server with checkpoints", {"parallel": {"dp": 2, "dp_mode": "ps-async"},
                                              "train": {"checkpoint_interval": 5}}),
    ("seq_len above max_seq_len", {"data": {"seq_len": 128}}),
    ("cp does not split the sequence", {"parallel": {"cp": 3}}),
    ("cp with a sequence not a multiple of 2cp", {"parallel": {"cp": 2},
                                                  "data": {"seq_len": 30}}),
    ("hybrid cp with a Ulysses degree not dividing cp",
     {"parallel": {"cp": 2, "cp_method": "hybrid", "cp_ulysses": 3}}),
    ("ulysses degree above the heads per tp rank",
     {"parallel": {"cp": 8, "cp_method": "ulysses"}, "data": {"seq_len": 64}}),
    ("cp with the parameter server", {"parallel": {"dp": 2, "cp": 2, "dp_mode": "ps"}}),
    ("sequence parallelism with seq_len not divisible by tp",
     {"parallel": {"tp": 2, "sequence_parallel": True}, "data": {"seq_len": 31}}),
    ("ep not dividing dp", {"parallel": {"dp": 3, "ep": 2}}),
    ("ZeRO-3 with tied embeddings and two chunks on one rank",
     {"model": {"tie_embeddings": True},
      "parallel": {"zero_stage": 3, "virtual_stages": 2, "schedule": "bfs"}}),
    ("profile beyond the run", {"train": {"steps": 3, "profile_steps": "2:9"}}),
    ("validation needs more tokens than the data's val split",
     {"data": {"val_tokens": 10 ** 9}}),
    ("vocabulary smaller than the data's", {"model": {"vocab_size": 100}}),
]


def combination(rng: random.Random) -> Case:
    label, values = rng.choice(COMBINATIONS)
    return _through(rng, f"combination: {label}", values)


def unknown(rng: random.Random) -> Case:
    section, name, _ = rng.choice(_all_fields())
    kind = rng.randrange(3)
    if kind == 0:  # misspelt field
        misspelt = name[:-1] if len(name) > 2 else name + "x"
        return _through(rng, f"unknown field {section}.{misspelt}", {section: {misspelt: 1}})
    if kind == 1:  # misspelt section
        return _through(rng, f"unknown section {section}s", {section + "s": {name: 1}})
    # a section that is not a table
    ext = rng.choice(["toml", "yaml"])
    text = f"{section} = 5\n" if ext == "toml" else f"{section}: 5\n"
    return Case(f"section {section} is not a table ({ext})",
                [*BASE, "--config", f"{{dir}}/run.{ext}"], {f"run.{ext}": text})


MALFORMED: list[tuple[str, str, str | bytes]] = [
    ("toml", "unclosed table header", "[model\nd_model = 64\n"),
    ("toml", "value missing", "[model]\nd_model =\n"),
    ("toml", "key missing", "[model]\n= 64\n"),
    ("toml", "duplicate key", "[model]\nd_model = 64\nd_model = 32\n"),
    ("toml", "duplicate table", "[model]\nd_model = 64\n[model]\nn_layers = 2\n"),
    ("toml", "unterminated string", '[data]\npath = "data/stdlib\n'),
    ("toml", "bare word value", "[train]\nprecision = bf16\n"),
    ("toml", "YAML in a .toml file", "model:\n  d_model: 64\n"),
    ("toml", "not UTF-8", b"[model]\nd_model = 64 \xff\xfe\n"),
    ("yaml", "unclosed flow sequence", "model: [1, 2\n"),
    ("yaml", "tab indentation", "model:\n\td_model: 64\n"),
    ("yaml", "bad mapping", "model: d_model: 64\n"),
    ("yaml", "empty file", ""),
    ("yaml", "only a comment", "# nothing here\n"),
    ("yaml", "top level is a list", "- model\n- train\n"),
    ("yaml", "top level is a number", "42\n"),
    ("yaml", "top level is a string", "just some text\n"),
    ("yaml", "a Python object tag", "model: !!python/object/apply:os.system ['true']\n"),
    ("yaml", "not UTF-8", b"model:\n  d_model: \xc3\x28\n"),
    ("yaml", "section is a list", "model:\n  - d_model\n  - 64\n"),
    ("yaml", "unknown anchor", "model: *nothing\n"),
    ("yaml", "impossible date", "train:\n  out_dir: 2020-13-45\n"),
    ("yaml", "duplicate anchors, unclosed quote", "model: {d_model: \"64}\n"),
]


# The file's own `preset` key, read when --preset is not given.
BAD_PRESETS: list[tuple[str, str, str]] = [
    ("toml", "preset of the wrong type", "preset = 5\n"),
    ("toml", "preset is a list", 'preset = ["tiny"]\n'),
    ("toml", "unknown preset", 'preset = "huge"\n'),
    ("yaml", "preset is a mapping", "preset: {name: tiny}\n"),
    ("yaml", "preset is a list", "preset: [tiny]\n"),
]


def malformed_file(rng: random.Random) -> Case:
    roll = rng.random()
    if roll < 0.05:
        return Case("config file missing", [*BASE, "--config", "{dir}/missing.toml"])
    if roll < 0.1:
        return Case("config path is a directory", [*BASE, "--config", "{dir}"])
    # Without --preset, the file is read first for its own preset (another code path).
    no_preset = [a for a in BASE if a not in ("--preset", "tiny")]
    if roll < 0.3:
        ext, label, text = rng.choice(BAD_PRESETS)
        return Case(f"file: {label} ({ext})", [*no_preset, "--config", f"{{dir}}/run.{ext}"],
                    {f"run.{ext}": text})
    ext, label, text = rng.choice(MALFORMED)
    base = no_preset if rng.random() < 0.5 else BASE
    return Case(f"file: {label} ({ext})", [*base, "--config", f"{{dir}}/run.{ext}"],
                {f"run.{ext}": text})


# --flag value pairs the command line must refuse.
BAD_FLAGS: list[list[str]] = [
    ["--tp", "abc"], ["--tp", "1.5"], ["--tp", "0"], ["--tp", "-2"], ["--dp", "x"],
    ["--pp", ""], ["--cp", "two"], ["--nproc", "abc"], ["--nproc", "0"], ["--nproc", "-1"],
    ["--steps", "1e3"], ["--steps", "0"], ["--steps", "-4"],
    ["--zero-stage", "5"], ["--zero-stage", "one"], ["--dp-mode", "sync"],
    ["--schedule", "zigzag"], ["--microbatches", "0"], ["--virtual", "0"],
    ["--virtual", "2"], ["--recompute", "some"], ["--precision", "fp8"],
    ["--micro-batch-size", "0"], ["--bucket-mb", "-1"], ["--bucket-mb", "nan"],
    ["--bucket-mb", "inf"], ["--peak-tflops", "0"], ["--peak-tflops", "inf"],
    ["--allreduce-algorithm", "tree"], ["--max-staleness", "0"], ["--cp-method", "mesh"],
    ["--cp-ulysses", "x"], ["--collective-timeout", "0"], ["--collective-timeout", "nan"],
    ["--collective-timeout", "inf"], ["--collective-timeout", "soon"],
    ["--max-restarts", "-1"], ["--max-restarts", "many"], ["--checkpoint-interval", "-3"],
    ["--checkpoint-interval", "x"], ["--profile-steps", "3"], ["--profile-steps", "9:2"],
    ["--resume", "{dir}/no-such-checkpoint"], ["--resume", "{dir}"],
    ["--init-from", "{dir}/no-such-weights"], ["--data", "{dir}/no-such-data"],
    ["--data", "{dir}"], ["--config", "{dir}/none.yaml"], ["--preset", "huge"],
    ["--preset", ""], ["--set", "lr=1"], ["--set", "train.lr"], ["--set", "=3"],
    ["--set", "train.=3"], ["--set", ".lr=3"], ["--set", "train.lr=abc"],
    ["--set", "model.n_layers=[2]"], ["--set", "train.lr={a: 1}"],
    ["--set", "train.lr=1e400"], ["--set", "model.d_model=1e3"],
    ["--set", "train.lr=[unclosed"], ["--no-such-flag", "1"], ["--tp"],
    ["--sequence-parallel", "--tp", "2", "--set", "data.seq_len=31"],
    ["--sequence-parallel=yes"], ["--no-progress=1"],
]


def bad_flag(rng: random.Random) -> Case:
    flags = rng.choice(BAD_FLAGS)
    base = list(BASE)
    if flags[0] in ("--data", "--preset"):  # replace the base's own
        i = base.index(flags[0])
        base[i:i + 2] = flags
        return Case(f"flag: {' '.join(flags)}", base)
    return Case(f"flag: {' '.join(flags)}", [*base, *flags])


HUGE_FLAGS: list[list[str]] = [
    ["--nproc", "2", "--pp", "2", "--microbatches", "10000000"],
    ["--microbatches", "70000"],
    ["--micro-batch-size", "1000000"],
    ["--micro-batch-size", "99999999999999999999"],
    ["--steps", "1" * 76],
    ["--nproc", "100000"],
    ["--stage-layout", "1*99999999999"],
]


def huge(rng: random.Random) -> Case:
    roll = rng.random()
    if roll < 0.2:
        flags = rng.choice(HUGE_FLAGS)
        return Case(f"huge: {' '.join(flags)[:60]}", [*BASE, *flags])
    if roll < 0.35:  # above a field's own maximum
        from tessera.config import LIMITS

        name, (limit, _) = rng.choice(sorted(LIMITS.items()))
        section, field_name = name.split(".")
        return _through(rng, f"huge: {name}={limit + 1}", {section: {field_name: limit + 1}})
    # Beyond int64 in an integer field; 5,000 digits in any numeric one (a float field takes a
    # large finite number: only the digits Python cannot read are invalid there).
    section, name, annotation = rng.choice([f for f in _all_fields()
                                            if "int" in f[2] or "float" in f[2]])
    value = rng.choice([2**63, -(2**63) - 1, 10**75, Digits("7" * 5000)]
                       if "int" in annotation else [Digits("7" * 5000)])
    label = (f"{len(value)}-digit integer" if isinstance(value, Digits)
             else f"{len(str(abs(value)))}-digit integer")
    return _through(rng, f"huge: {section}.{name}={label}", {section: {name: value}})


CATEGORIES = [wrong_type, out_of_range, combination, unknown, malformed_file, bad_flag, huge]


def cases(seed: int, n: int) -> list[Case]:
    """`n` invalid inputs drawn from `seed`, round-robin over the categories."""
    rng = random.Random(seed)
    drawn = []
    for i in range(n):
        make = CATEGORIES[i % len(CATEGORIES)]
        case = make(rng)
        case.category = make.__name__
        drawn.append(case)
    return drawn


if __name__ == "__main__":
    # Run every case once, in this process, through the CLI's entry function:
    #   python tests/config_fuzz.py [N=300] [SEED=0] [DATA_DIR]
    import contextlib
    import io
    import sys
    import tempfile
    from pathlib import Path

    from tessera.cli import main

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    data = sys.argv[3] if len(sys.argv) > 3 else "data/stdlib"
    failed = 0
    for i, case in enumerate(cases(seed, n)):
        scratch = Path(tempfile.mkdtemp(prefix="tessera-fuzz-"))
        for name, text in case.files.items():
            (scratch / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main(case.resolve(str(scratch), data))
                code = 0
            except SystemExit as e:
                code = e.code
            except Exception as e:  # noqa: BLE001 - a crash is what we look for
                code = f"raised {type(e).__name__}: {e}"
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        ok = code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} #{i} {case.label}: "
              f"{lines[0] if ok else (code, lines[-3:])}")
    print(f"{n - failed} of {n} cases gave one line and exit 2")
    sys.exit(1 if failed else 0)
