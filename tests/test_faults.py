"""Faults: a rank that dies, stops or is killed mid-save, under the real elastic launcher.

The launched tests run `tessera train --nproc 2` in a subprocess (tiny model, 2 ranks) and do
the fault from outside with a real signal on a rank's real pid, found as the launcher's child
whose environment says RANK=r: SIGSTOP (the others must stop within the collective timeout,
naming the rank), SIGKILL under --max-restarts 1 (the surviving rank says in one line that it
lost a peer; the restarted job resumes from the newest checkpoint, marks the restart in
metrics.jsonl, and ends with the same final loss as a run never interrupted: tolerance 0, since
the same layout resumes bit for bit, tests/test_checkpoint.py), and SIGKILL while a checkpoint
is being written (the previous checkpoint stays whole and the restart resumes from it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from cli_errors import cli_error
from tessera.checkpoint import latest
from tessera.config_io import make_config
from tessera.metrics import read_log, read_metrics
from tessera.testing import run_ranks
from tessera.watchdog import Watchdog

TINY = ["--preset", "tiny", "--no-progress", "--set", "data.seq_len=16", "--set",
        "data.val_tokens=256", "--set", "train.sample_tokens=0"]


# ---------------------------------------------------------------------------------------------
# The collective timeout and the watchdog, in this process


def test_collective_timeout_reaches_groups_made_later(monkeypatch):
    """torch gives dist.new_group (and DeviceMesh) its module default, 30 minutes for gloo,
    not the default group's timeout; init_distributed makes both the configured one."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    from tessera.trainer import init_distributed

    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    init_distributed("gloo", None, timeout_s=7)
    try:
        later = dist.new_group([0])
        for group in (dist.group.WORLD, later):
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def _watch(store, rank: int, world: int, lost: list[str]) -> Watchdog:
    """Collective timeout 2 s: a rank is lost after 1 s of silence (half the timeout)."""
    return Watchdog(store, rank, world, timeout_s=2.0, interval_s=0.05,
                    on_lost=lambda message: lost.append(message))


def test_watchdog_names_the_silent_rank():
    """Rank 0 watches rank 1 (the ring's next rank): beats from rank 1 keep it quiet; once they
    stop for the limit (half the timeout, 1 s here), rank 0 names rank 1, and a third rank that
    watches someone else reads the same verdict from the store."""
    store, lost0, lost2 = _store(), [], []
    rank1 = _watch(store, 1, 3, [])  # never started: its beats are ours to give
    dog0, dog2 = _watch(store, 0, 3, lost0), _watch(store, 2, 3, lost2)
    dog0.start(), dog2.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # beats for longer than the limit: no alarm
        last_beat = time.monotonic()  # before the beat: the watchdog cannot see it earlier
        rank1.store.add("beat/1", 1)
        time.sleep(0.05)
    assert lost0 == [] and lost2 == []
    while not (lost0 and lost2) and time.monotonic() - last_beat < 30:  # a deadlock guard
        time.sleep(0.01)
    # Not before the limit of silence after the last beat, on this clock and in the
    # watchdog's message; a busy machine only makes it later, so no upper window.
    assert time.monotonic() - last_beat > 1.0
    assert re.fullmatch(r"rank 1 stopped answering \(no heartbeat for \d+\.\d s, seen by "
                        r"rank 0; collective timeout 2 s\)", lost0[0]), lost0
    assert float(re.search(r"for (\d+\.\d) s", lost0[0])[1]) >= 1.0
    assert lost2 == lost0


def test_watchdog_lets_a_finished_rank_go():
    """A rank that marks itself done (stop(), at the end of training) is not reported when its
    beats stop; the watcher keeps beating for the ranks that watch it."""
    store, lost0, lost1 = _store(), [], []
    dog0, dog1 = _watch(store, 0, 2, lost0), _watch(store, 1, 2, lost1)
    dog0.start(), dog1.start()
    time.sleep(0.3)
    dog1.stop()
    time.sleep(2.5)  # more than twice the limit
    assert lost0 == [] and lost1 == []
    dog0.stop()


# What torch 2.13's gloo raises in a rank whose peer was killed (kill -9) before or during
# all_reduce, barrier, send/recv, all_gather (a RuntimeError); and torch's store client.
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:37250. This is typically caused by a "
               "remote worker crashing. Check the logs of the remote worker before reporting an "
               "error. GLHF! \N{UMBRELLA ON GROUND}")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
              "error [127.0.0.1]:47814: Connection reset by peer. This is typically caused by a "
              "remote worker hanging or bugs in the application.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:"
                "78] Timed out waiting 3000ms for recv operation to complete")


def test_peer_loss_is_told_from_other_errors():
    from tessera.watchdog import peer_loss_reason

    assert peer_loss_reason(RuntimeError(GLOO_CLOSED)) == (
        "Connection closed by peer [127.0.0.1]:37250")
    assert peer_loss_reason(RuntimeError(GLOO_RESET)) == (
        "Read error [127.0.0.1]:47814: Connection reset by peer")
    assert peer_loss_reason(dist.DistBackendError(GLOO_CLOSED)) is not None
    assert peer_loss_reason(dist.DistNetworkError(
        "Failed to recv, got 0 bytes. Connection was likely closed.")) == (
        "Failed to recv, got 0 bytes")
    # A late rank or a desync (timeout), a bug, an error of another kind: not a lost peer.
    for error in (RuntimeError(GLOO_TIMEOUT),
                  RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
                  ValueError("Connection closed by peer"), KeyError("step")):
        assert peer_loss_reason(error) is None, error


@pytest.mark.parametrize("restart, interval, then", [
    ("0", 5, "the launcher restarts it from the newest checkpoint (restart 1 of 2)"),
    ("1", 0, "the launcher restarts it from where this run began (restart 2 of 2)"),
    ("2", 5, "the launcher's summary names the rank that failed; --resume latest goes on from "
             "the newest checkpoint"),
    ("2", 0, "the launcher's summary names the rank that failed; with no checkpoints "
             "(--checkpoint-interval) a new run starts over")])
def test_a_lost_peer_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch, restart, interval,
                                                                then):
    """trainer.run turns a collective's lost-peer error into PeerLostError with the line the
    CLI prints (the step from train's position, what happens next); any other error passes
    through unchanged."""
    from tessera import trainer

    def failing(error: BaseException, stage: str):
        def train(cfg, progress=True, position=None):
            position.stage = stage
            raise error
        return train

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("RANK", "3")
    cfg = make_config("tiny", overrides=[f"train.checkpoint_interval={interval}"])
    monkeypatch.setattr(trainer, "train", failing(RuntimeError(GLOO_CLOSED), "step 7"))
    with pytest.raises(trainer.PeerLostError) as lost:
        trainer.run(cfg)
    assert str(lost.value) == ("rank 3 lost a peer during step 7 (Connection closed by peer "
                               f"[127.0.0.1]:37250): the job stops; {then}")
    assert lost.value.__suppress_context__  # raised `from None`: no chained traceback
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")
    monkeypatch.setattr(trainer, "train", failing(bug, "step 7"))
    with pytest.raises(RuntimeError) as raised:
        trainer.run(cfg)
    assert raised.value is bug


def test_fault_flags_are_checked(tiny_data):
    line = cli_error(["train", "--data", tiny_data, *TINY, "--collective-timeout", "0"])
    assert "train.collective_timeout_s=0.0: must be a finite number of seconds >= 1" in line
    assert "--max-restarts=-1: must be >= 0" in cli_error(
        ["train", "--data", tiny_data, *TINY, "--nproc", "2", "--max-restarts", "-1"])


# ---------------------------------------------------------------------------------------------
# Under the elastic launcher


class Job:
    """`tessera train --nproc 2 ...` in a subprocess; stderr read as it comes, with times."""

    def __init__(self, data: str, out: Path, *args: str, steps: int):
        self.out = out
        cmd = [sys.executable, "-m", "tessera", "train", "--data", data, "--nproc", "2",
               "--steps", str(steps), "--out", str(out), *TINY, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.stderr: list[tuple[float, str]] = []
        self.stdout: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, ), daemon=True)
                         for s in (self.proc.stderr, self.proc.stdout)]
        for r in self._readers:
            r.start()

    def _read(self, stream) -> None:
        for line in stream:
            if stream is self.proc.stderr:
                self.stderr.append((time.monotonic(), line.rstrip("\n")))
            else:
                self.stdout.append(line.rstrip("\n"))

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        """Until metrics.jsonl (written by rank 0 after each step) shows `step`."""
        metrics, t0 = self.out / "metrics.jsonl", time.monotonic()
        while time.monotonic() - t0 < timeout:
            if metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics)):
                return
            assert self.proc.poll() is None, self.report()
            time.sleep(0.02)
        raise AssertionError(f"no step {step} after {timeout} s\n{self.report()}")

    def rank_pid(self, rank: int) -> int:
        """The pid of the launcher's child that runs `rank` (its environment says so)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid and (
                    f"RANK={rank}".encode() in environ):
                return int(entry)
        raise AssertionError(f"no rank {rank} under {self.proc.pid}")

    def wait(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout)
        for r in self._readers:
            r.join(5)
        return code

    def report(self) -> str:
        return "\n".join(["--- stdout", *self.stdout[-30:], "--- stderr",
                          *(ln for _, ln in self.stderr[-60:])])


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000",  # 127.0.0.1, ::1
                "0000000000000000FFFF00000100007F"}  # ::ffff:127.0.0.1


def _listening(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address in /proc/net's hex) of every TCP socket these processes listen on."""
    owner = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in owner:  # state LISTEN, inode
                found.append((owner[cols[9]], cols[1]))
    return found


def _losses(out: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl; a resumed run appends, and its records win."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


SLOW_AGENT = ("PET_MONITOR_INTERVAL", "1")
"""The launcher's agent looks at its ranks every second (torchrun's --monitor-interval; 0.1 s
by default): the surviving rank, whose next collective fails at once, then says so before the
agent's SIGTERM ends it, on a loaded machine too."""


def _check_restart(job: Job, resumed_from: Path, at: int) -> None:
    """After rank 1 was killed under --max-restarts 1: rank 0 said in one line that it lost its
    peer (gloo's traceback left out), and metrics.jsonl marks the restart before the steps
    from `at` + 1 on, logged again."""
    lost = [ln for _, ln in job.stderr if "lost a peer" in ln]
    assert len(lost) == 1 and re.fullmatch(
        r"error: rank 0 lost a peer during step (\d+) \((Connection closed by peer|Read error)"
        r" [^()]*\): the job stops; the launcher restarts it from the newest checkpoint "
        r"\(restart 1 of 1\)", lost[0]), job.report()
    assert at < int(lost[0].split("during step ")[1].split()[0]), lost
    assert not any("Traceback" in ln for _, ln in job.stderr), job.report()
    lines = (job.out / "metrics.jsonl").read_text().splitlines()
    markers = [i for i, ln in enumerate(lines) if '"event"' in ln]
    assert len(markers) == 1, lines
    marker = json.loads(lines[markers[0]])
    assert {k: v for k, v in marker.items() if k != "time"} == {
        "event": "restart", "from_step": at, "restart": 1, "checkpoint": str(resumed_from)}
    assert json.loads(lines[markers[0] + 1])["step"] == at + 1
    assert read_log(job.out / "metrics.jsonl")[1] == [marker]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stopped_rank", [1, 0])
def test_stopped_rank_is_named_within_the_collective_timeout_on_loopback(tiny_data, tmp_path,
                                                                        stopped_rank):
    """Rank 1: its watcher, rank 0, sees its heartbeat stop. Rank 0: it also serves the ranks'
    store, which stops answering with it; rank 1 names it from the store's silence."""
    timeout = 8
    job = Job(tiny_data, tmp_path / "run", "--collective-timeout", str(timeout), steps=5000)
    try:
        job.wait_for_step(3)
        # Security: the launcher's rendezvous, rank 0's store and gloo listen on loopback only.
        pids = [job.proc.pid, job.rank_pid(0), job.rank_pid(1)]
        listening = _listening(pids)
        assert {pid for pid, _ in listening} == set(pids), listening
        assert all(addr.split(":")[0] in LOOPBACK_HEX for _, addr in listening), listening
        stopped = job.rank_pid(stopped_rank)
        os.kill(stopped, signal.SIGSTOP)
        t_stop, named = time.monotonic(), f"error: rank {stopped_rank} stopped answering ("
        while not any(ln.startswith(named) for _, ln in job.stderr):
            assert time.monotonic() - t_stop < timeout + 30, job.report()
            time.sleep(0.05)
        # The launcher then sees the other rank exit and stops the group: SIGTERM, which a
        # stopped process holds until the launcher's 30 s grace ends in SIGKILL; we send it now.
        os.kill(stopped, signal.SIGKILL)
        assert job.wait() != 0
    finally:
        job.proc.kill()
    errors = [ln for _, ln in job.stderr if ln.startswith("error: ")]
    other = 1 - stopped_rank
    silence = (rf"no heartbeat for \d+\.\d s, seen by rank {other}" if stopped_rank == 1 else
               rf"the rendezvous store it serves has not answered rank {other} for \d+\.\d s: "
               r"[^;]+")
    assert re.fullmatch(rf"error: rank {stopped_rank} stopped answering \({silence}; "
                        rf"collective timeout {timeout} s\)", errors[0]), job.report()
    # Named after half the timeout of silence on the watchdog's clock; before a collective
    # blocked on the stopped rank timed out, which would have ended the job with gloo's
    # message, naming no rank. No window on this clock: a busy machine only makes it later.
    assert float(re.search(r" for (\d+\.\d) s", errors[0])[1]) >= timeout / 2, errors[0]
    assert errors[-1].startswith("error: 2 of 2 ranks failed ("), errors
    assert not any("Traceback" in ln for _, ln in job.stderr), job.report()



def _uninterrupted_rank(data: str, out: str, steps: int) -> None:
    from tessera.trainer import train

    train(make_config("tiny", overrides=[
        f"data.path={data}", "data.seq_len=16", "data.val_tokens=256", "train.sample_tokens=0",
        f"train.steps={steps}", "parallel.dp=2", f"train.out_dir={out}"]), progress=False)


STEPS, EVERY = 40, 5


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory) -> dict[int, float]:
    """Step -> loss of the same 2-rank run (dp=2) never interrupted, through the test
    harness (no checkpoints: saving does not touch the numbers)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_ranks(_uninterrupted_rank, 2, args=(tiny_data, str(out), STEPS), timeout=240)
    return _losses(out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(tiny_data, tmp_path,
                                                                 uninterrupted, monkeypatch):
    monkeypatch.setenv(*SLOW_AGENT)
    steps, every = STEPS, EVERY
    job = Job(tiny_data, tmp_path / "run", "--max-restarts", "1", "--checkpoint-interval",
              str(every), steps=steps)
    try:
        job.wait_for_step(1)
        rank1 = job.rank_pid(1)  # found early: the steps left after step 6 take under a second
        job.wait_for_step(every + 1)  # the step-5 checkpoint is complete before step 6 runs
        os.kill(rank1, signal.SIGKILL)
        assert job.wait() == 0, job.report()
    finally:
        job.proc.kill()
    resumed = [ln for ln in job.stdout if ln.startswith("resumed from ")]
    assert len(resumed) == 1 and resumed[0].endswith("(restart 1)"), job.report()
    # The restart resumed from the newest complete checkpoint, not from the start.
    at = int(resumed[0].split(" at step ")[1].split()[0])
    assert every <= at < steps and at % every == 0, resumed
    _check_restart(job, tmp_path / "run" / "checkpoints" / f"step-{at:07d}", at)
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(1, steps + 1))
    assert got == uninterrupted  # every step's loss, the final one included: bit for bit


# Loaded by every Python the job starts (PYTHONPATH): rank 1 of the first attempt stops itself
# (SIGSTOP) as it starts writing a file into the checkpoint directory of step 10, so the test
# can kill it there, mid-save, with a real kill -9. Writers: torch.save (its C++ writer opens
# the file itself) and Python's open, builtins' and io's (pathlib's Path.open, which
# torch.distributed.checkpoint's file system writer uses, calls io.open).
STOP_WHILE_SAVING = """
import builtins, io, os, signal

marker = os.environ.get("TESSERA_TEST_STOP_SAVING")
if marker and os.environ.get("RANK") == "1" and (
        os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
    import torch

    def _stop_if_there(file):
        if isinstance(file, (str, os.PathLike)) and marker in os.fspath(file):
            os.kill(os.getpid(), signal.SIGSTOP)

    _open, _save = builtins.open, torch.save

    def _open_stopping(file, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            _stop_if_there(file)
        return _open(file, mode, *args, **kwargs)

    def _save_stopping(obj, f, *args, **kwargs):
        _stop_if_there(f)
        return _save(obj, f, *args, **kwargs)

    builtins.open = io.open = _open_stopping
    torch.save = _save_stopping
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tiny_data, tmp_path,
                                                                 uninterrupted, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(STOP_WHILE_SAVING)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("TESSERA_TEST_STOP_SAVING", "step-0000010")
    monkeypatch.setenv(*SLOW_AGENT)
    root = tmp_path / "run" / "checkpoints"
    job = Job(tiny_data, tmp_path / "run", "--max-restarts", "1", "--checkpoint-interval",
              str(EVERY), steps=STEPS)
    try:
        job.wait_for_step(10)
        rank1, t0 = job.rank_pid(1), time.monotonic()
        while not _stopped(rank1):
            assert time.monotonic() - t0 < 60 and job.proc.poll() is None, job.report()
            time.sleep(0.02)
        # Rank 1 is inside step 10's save: its directory is there, unfinished; step 5's is
        # the newest complete one.
        assert any(p.name.startswith("step-0000010") for p in root.iterdir())
        assert latest(root).name == "step-0000005"
        os.kill(rank1, signal.SIGKILL)
        assert job.wait() == 0, job.report()
    finally:
        job.proc.kill()
    resumed = [ln for ln in job.stdout if ln.startswith("resumed from ")]
    assert resumed == [f"resumed from {root / 'step-0000005'} at step 5 (restart 1)"], (
        job.report())
    _check_restart(job, root / "step-0000005", 5)
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == uninterrupted


def test_a_restarted_job_resumes_from_the_newest_checkpoint(tmp_path, monkeypatch):
    from tessera.run_dir import resume_path

    root = tmp_path / "checkpoints"
    cfg = make_config("tiny", overrides=[f"train.checkpoint_dir={root}"])
    named = make_config("tiny", overrides=[f"train.checkpoint_dir={root}",
                                           f"train.resume={tmp_path / 'elsewhere'}"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_path(cfg) is None  # a first attempt starts fresh
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_path(cfg) is None  # restarted before its first checkpoint
    assert resume_path(named) == tmp_path / "elsewhere"  # ... where the job began
    for step in (5, 10):
        (root / f"step-{step:07d}").mkdir(parents=True)
        (root / f"step-{step:07d}" / "meta.json").write_text("{}")
    (root / "step-0000015.tmp").mkdir()  # a save cut off: not a checkpoint
    assert resume_path(cfg) == root / "step-0000010"
    assert resume_path(named) == root / "step-0000010"  # its own newest state wins


def test_max_restarts_belongs_to_an_outer_torchrun(tiny_data, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    line = cli_error(["train", "--data", tiny_data, *TINY, "--max-restarts", "1"])
    assert "--max-restarts=1: is the launcher's: under torchrun, give it to torchrun" in line


def test_watchdog_names_the_rank_that_serves_a_silent_store():
    """Under tessera's launcher rank 0 serves the ranks' store: when the store stops
    answering, the other ranks name rank 0."""
    server = _store()
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=1))
    lost: list[str] = []
    dog = _watch(client, 1, 2, lost)
    dog.store_host = 0
    dog.start()
    del server  # the store's process is gone
    t0 = time.monotonic()
    while not lost and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert lost and lost[0].startswith(
        "rank 0 stopped answering (the rendezvous store it serves has not answered rank 1 for"
    ), lost
