"""The pipeline runtime against the single-device reference, on gloo ranks.

Every schedule at pp ∈ {2, 4}, v ∈ {1, 2} where the schedule has chunks, m ∈ {1, p, 2p+1}
where allowed (interleaved and interleaved-lean need m a multiple of p: m ∈ {p, 2p}; with
micro-batch groups of p + 1, m ∈ {p + 1, 2p + 2}); tied and untied embeddings;
pp=2 × dp=2; a custom V-shaped schedule. Each case trains 10 AdamW steps with gradient clipping
next to the single-device model and compares the loss, the gradient norm, every gradient and
every weight at every step: bitwise where the pipeline sums in the reference's order (untied,
one replica: `is_exact`), else within the summation bound of tessera.testing, against a
Shadow (tests/dp_parity.py) started each step from the pipeline's own parameters (a
free-running reference would let Adam amplify the round-off).
"""

from __future__ import annotations

import functools
import pickle
import weakref

import pytest
import torch

from dp_parity import ADAM_ROUNDINGS, Shadow, clip_like_engine
from tessera.config_io import make_config
from tessera.model import build_model, cross_entropy
from tessera.optim import adamw
from tessera.pipeline.runtime import PipelineRuntime, _tag
from tessera.pipeline.schedule import Action, Kind, Schedule, lower_comms, matching, parse
from tessera.pipeline.schedules import build_schedule
from tessera.step import build_executor
from tessera.testing import run_ranks, summation_error
from tessera.topology import Topology
from test_pipeline_schedule import grid_cases

STEPS = 10
MBS, SEQ, VOCAB = 2, 16, 64


def case_config(schedule: str, pp: int, m: int, v: int = 1, dp: int = 1, tie: bool = False,
                layers: int = 4, custom: str | None = None, group: int = 0,
                extra: dict | None = None):
    """`extra`: more parallel settings (zero_stage, recompute, ...)."""
    return make_config(
        "tiny",
        model=dict(vocab_size=VOCAB, d_model=32, n_layers=layers, n_heads=2, n_kv_heads=1,
                   max_seq_len=32, tie_embeddings=tie),
        parallel=dict(pp=pp, dp=dp, schedule=schedule, virtual_stages=v, microbatch_group=group,
                      **(extra or {})),
        train=dict(grad_accum=m, micro_batch_size=MBS, steps=STEPS, lr=1e-3, grad_clip=0.5,
                   out_dir="/nonexistent-not-written"),
        data=dict(seq_len=SEQ))


def step_batches(step: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (n, MBS, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@functools.cache
def reference_trajectory(layers: int, n_micro: int):
    """The single-device untied model trained STEPS steps on the global batches (n_micro
    micro-batches each, gradients accumulated per micro-batch with the loss scaled by
    1/n_micro): per step the loss, the gradient norm and the clipped gradients, and the
    parameters after the step. Computed once in the test process and handed to every rank."""
    cfg = case_config("1f1b", 1, n_micro, layers=layers)
    model = build_model(cfg.model, cfg.train.seed)
    opt = adamw(model.parameters(), cfg.train)
    steps = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for x, y in step_batches(step, n_micro):
            part = cross_entropy(model(x), y) / n_micro
            part.backward()
            loss += float(part.detach())
        norm = clip_like_engine(list(model.parameters()), cfg.train.grad_clip)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        steps.append((loss, norm, grads, {n: p.detach().clone()
                                          for n, p in model.named_parameters()}))
    return steps


def is_exact(case: dict) -> bool:
    """Untied, one replica: every gradient is summed in the reference's order, by the same
    kernels on the same shapes, and stepped by the same AdamW, so the pipeline is bitwise equal
    to the free-running reference (whatever the kernel set: the same kernels on both sides)."""
    return not case.get("tie") and case.get("dp", 1) == 1


def reference_key(case: dict) -> tuple[int, int]:
    return case.get("layers", 4), case["m"]


def _check(used: dict[str, float], kind: str, got: torch.Tensor, want: torch.Tensor,
           terms: int, label: str) -> bool:
    """Record the share of the summation bound used; return whether the two are bitwise equal."""
    used[kind] = max(used[kind], summation_error(got, want, terms=terms, msg=f"{label} {kind}"))
    return torch.equal(got, want)


def run_parity_cases(cases, references: bytes, steps: int = STEPS):
    """Train every case `steps` steps (at most STEPS). Exact cases (`is_exact`) against the
    free-running reference; the others next to a Shadow (tests/dp_parity.py) started each step
    from the pipeline's own parameters, with the global batch as one micro-batch. Per case: the
    largest share of each summation bound used, and whether gradients and weights were bitwise
    equal."""
    references = pickle.loads(references)
    topos: dict = {}
    out = []
    for case in cases:
        cfg = case_config(**case)
        p = cfg.parallel
        if (p.pp, p.dp) not in topos:
            topos[(p.pp, p.dp)] = Topology.build(p)
        topo = topos[(p.pp, p.dp)]
        custom = parse(case["custom"]) if "custom" in case else None
        engine = build_executor(cfg, topo, torch.device("cpu"), schedule=custom)
        engine.cfg.train.steps = STEPS + 1  # no timeline pictures from this test
        opt = engine.optimizer(cfg.train)
        shadow = None if is_exact(case) else Shadow(cfg)
        dp_rank, m = topo.coords()["dp"], cfg.train.grad_accum
        # Sums in another order than the reference's: over the tokens of the global batch
        # (micro-batch means, dp ranks' partial means, a tied weight's two copies' gradients).
        tokens = p.dp * m * MBS * SEQ
        used = dict.fromkeys(("loss", "norm", "grad", "weight"), 0.0)
        exact = True
        for step in range(steps):
            batches = step_batches(step, p.dp * m)
            if shadow is not None:
                before = engine.full_state_dict()
                whole = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
                twin = shadow.gradients(before, [whole])
                want_loss, want_norm, want_grads = twin["loss"], twin["norm"], twin["clipped"]
            else:
                want_loss, want_norm, want_grads, want_params = \
                    references[reference_key(case)][step]
            opt.zero_grad(set_to_none=True)
            loss = engine.forward_backward(batches[dp_rank * m:(dp_rank + 1) * m])
            norm = engine.clip_grad_norm_(cfg.train.grad_clip)
            label = f"{case} step {step}"
            used["loss"] = max(used["loss"], summation_error(loss, want_loss, terms=tokens,
                                                             msg=f"{label} loss"))
            used["norm"] = max(used["norm"], summation_error(norm, want_norm, terms=tokens,
                                                             msg=f"{label} norm"))
            grads: dict[str, torch.Tensor | None] = {}
            for chunk in engine.model.chunks.values():
                for name, param in chunk.named_parameters():
                    ref_name = chunk.reference_name(name)
                    exact &= _check(used, "grad", param.grad, want_grads[ref_name], tokens,
                                    f"{label} {ref_name}")
                    grads[ref_name] = param.grad
            opt.step()
            if shadow is not None:
                # AdamW on this rank's parameters against AdamW from the same parameters with
                # the same gradients (the others, grad None, skipped): the same arithmetic.
                want_params = shadow.optimizer_step(
                    before, {n: grads.get(n) for n in shadow.params})
            for chunk in engine.model.chunks.values():
                for name, param in chunk.named_parameters():
                    ref_name = chunk.reference_name(name)
                    exact &= _check(used, "weight", param.detach(), want_params[ref_name],
                                    ADAM_ROUNDINGS, f"{label} {ref_name}")
        out.append((case, used, exact))
    return out


def parity_cases(pp: int) -> list[dict]:
    layers = 4 if pp == 2 else 8
    cases = []
    for m in (1, pp, 2 * pp + 1):
        for schedule in ("naive", "gpipe", "1f1b"):
            cases.append(dict(schedule=schedule, pp=pp, m=m, layers=layers, tie=m == pp))
        for v in (1, 2):
            cases.append(dict(schedule="bfs", pp=pp, m=m, v=v, layers=layers, tie=v == 2))
    for m in (pp, 2 * pp):  # interleaved needs v >= 2 (v = 1 is 1f1b, above)
        cases.append(dict(schedule="interleaved", pp=pp, m=m, v=2, layers=layers, tie=m == pp))
        cases.append(dict(schedule="interleaved-lean", pp=pp, m=m, v=2, layers=layers,
                          tie=m == pp))
    # Micro-batch groups above p (Llama 3's N; m a multiple of the group).
    for group, m in ((pp + 1, pp + 1), (pp + 1, 2 * pp + 2)):
        cases.append(dict(schedule="interleaved", pp=pp, m=m, v=2, layers=layers, group=group))
    return cases


def check_results(results):
    for case, used, exact in results:
        if is_exact(case):
            assert exact, (case, used)
        # Tied embeddings sum the head's and the embedding's micro-batch gradients in another
        # order (per copy, then across ranks), dp averages over ranks: the summation bound.
        assert all(v <= 1 for v in used.values()), (case, used)


def references_for(cases) -> bytes:
    """The reference trajectories the exact cases need, pickled by value: handed to the ranks
    as plain bytes, not as tensors (which multiprocessing would share through file
    descriptors)."""
    return pickle.dumps({reference_key(c): reference_trajectory(*reference_key(c))
                         for c in cases if is_exact(c)})


def first_stage_activation_peaks(pp: int = 2) -> dict[tuple[str, int], int]:
    """Peak bytes autograd holds for backward on the first stage, per (schedule, m)."""
    topo = Topology.build(case_config("gpipe", pp, 1).parallel)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8):
            cfg = case_config(schedule, pp, m)
            engine = build_executor(cfg, topo, torch.device("cpu"), measure_memory=True)
            engine.cfg.train.steps = 0
            engine.forward_backward(step_batches(0, m))
            peaks[(schedule, m)] = engine.last_record.peak_activation_bytes
    for schedule in ("interleaved", "interleaved-lean"):  # two chunks per rank, m = 4
        cfg = case_config(schedule, pp, 4, v=2)
        engine = build_executor(cfg, topo, torch.device("cpu"), measure_memory=True)
        engine.cfg.train.steps = 0
        engine.forward_backward(step_batches(0, 4))
        peaks[(schedule, 4)] = engine.last_record.peak_activation_bytes
    return peaks


# A custom schedule with V-shaped placement (chunks 0 and 3 on rank 0, 1 and 2 on rank 1, as
# in zero-bubble V schedules): the first and last chunks share a rank, so a tied embedding is
# one parameter there. Breadth-first order over that placement.
V_SHAPE = ("rank 0: 0F0 0F1 0F2 3F0 3F1 3F2 3B0 3B1 3B2 0B0 0B1 0B2\n"
           "rank 1: 1F0 1F1 1F2 2F0 2F1 2F2 2B0 2B1 2B2 1B0 1B1 1B2")


def pp2_checks(cases, references):
    return run_parity_cases(cases, references), first_stage_activation_peaks()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_schedule_matches_reference_pp2_and_memory():
    cases = parity_cases(2) + [dict(schedule="bfs", pp=2, m=3, v=2, tie=True,
                                    custom=V_SHAPE)]
    results = run_ranks(pp2_checks, 2, args=(cases, references_for(cases)), timeout=300)
    for per_rank, _ in results:
        assert [c for c, *_ in per_rank] == cases
        check_results(per_rank)
    # Memory measured in the runtime on the first stage: bytes of the tensors autograd saves
    # (distinct storages, parameters excluded), added at each forward and released at its
    # backward. GPipe holds every micro-batch at the turn; 1F1B at most p = 2.
    peaks = results[0][1]
    one = peaks[("gpipe", 1)]
    assert one > 0
    assert [peaks[("gpipe", m)] for m in (1, 2, 4, 8)] == [m * one for m in (1, 2, 4, 8)]
    assert [peaks[("1f1b", m)] for m in (1, 2, 4, 8)] == [one, 2 * one, 2 * one, 2 * one]
    # Two chunks of half the layers each on the first stage (the embedding's and the third's):
    # Megatron's warm-up holds 2(p-1) + p + 1 = 5 (micro-batch, chunk) sets there, the lean
    # warm-up (p-1) + p + 1 = 4; the embedding chunk's sets are at least as large as the
    # other's (same blocks, plus the embedding's output), so lean holds less.
    assert peaks[("interleaved-lean", 4)] < peaks[("interleaved", 4)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_schedule_matches_reference_pp4_and_pp2_dp2():
    cases = parity_cases(4)
    cases += [dict(schedule=s, pp=2, dp=2, m=m, v=v, tie=True)
              for s, m, v in (("1f1b", 3, 1), ("interleaved", 4, 2), ("bfs", 2, 2))]
    results = run_ranks(run_parity_cases, 4, args=(cases, references_for(cases)), timeout=300)
    for per_rank in results:
        assert [c for c, *_ in per_rank] == cases
        check_results(per_rank)


# ---------------------------------------------------------------------------------------------
# Message tags: every activation and gradient lands on the micro-batch it was sent for.


def _registered_schedule_rank(references: bytes):
    """Register a schedule under a new name in this rank (GPipe's generator), then train the
    case that names it: config, layout check, executor and runtime all look it up by name."""
    from tessera.pipeline.schedules import SCHEDULES, ScheduleSpec, register

    register(ScheduleSpec(name="test-registered", generate=SCHEDULES["gpipe"].generate,
                          description="GPipe under another name"))
    return run_parity_cases([REGISTERED_CASE], references)


REGISTERED_CASE = dict(schedule="test-registered", pp=2, m=3, layers=4)


@pytest.mark.multiprocess
def test_a_registered_schedule_trains_by_name():
    """docs/pipeline.md: adding a schedule is one register() call; the trainer then runs it
    by name. Untied and one replica, so bitwise equal to the reference (is_exact)."""
    results = run_ranks(_registered_schedule_rank, 2,
                        args=(references_for([REGISTERED_CASE]),), timeout=300)
    for per_rank in results:
        assert [c for c, *_ in per_rank] == [REGISTERED_CASE]
        check_results(per_rank)


def test_every_message_of_every_schedule_has_its_own_tag():
    """Both ends of every send/receive pair compute the same tag, and no two messages between
    the same two ranks share one, for every built-in schedule over a grid of (p, v, m). The
    runtime posts receives ahead of time; two messages with one tag would be matched by
    arrival order only."""
    checked = 0
    for name, p, v, m in grid_cases():
        s = lower_comms(build_schedule(name, p, m, v))
        tags: dict[tuple[int, int], dict[int, str]] = {}
        for rank, actions in enumerate(s.actions):
            for a in actions:
                if not a.kind.is_send:
                    continue
                peer = s.chunk_rank[matching(a).chunk]
                assert _tag(a, m) == _tag(matching(a), m), (name, p, v, m, a)
                seen = tags.setdefault((rank, peer), {})
                assert _tag(a, m) not in seen, (name, p, v, m, a, seen[_tag(a, m)])
                seen[_tag(a, m)] = str(a)
                checked += 1
    assert checked > 1000


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)

    def forward(self, tokens):
        return self.emb(tokens)  # (B, T, 8)


def _crossed_receives() -> list[float]:
    """pp=2, forward only: rank 0 sends micro-batch 0's activation, then micro-batch 1's;
    rank 1 posts the receive for micro-batch 1 first. The validator refuses this order
    (NCCL matches messages by order); gloo matches by tag, so with the validator set aside,
    the runtime's tags alone decide which activation lands on which micro-batch. Returns the
    per-micro-batch losses rank 1 computed and the ones it should have."""
    import tessera.pipeline.runtime as runtime

    runtime.validate = lambda s: s  # this rank's process only
    torch.manual_seed(0)
    first, last = _Embed(), torch.nn.Linear(8, VOCAB)
    rank = torch.distributed.get_rank()
    f, send, recv = Kind.F, Kind.SEND_F, Kind.RECV_F
    schedule = Schedule("crossed", [
        [Action(0, f, 0), Action(0, send, 0), Action(0, f, 1), Action(0, send, 1)],
        [Action(1, recv, 1), Action(1, recv, 0), Action(1, f, 0), Action(1, f, 1)],
    ], n_chunks=2, n_microbatches=2)
    rt = PipelineRuntime({rank: first if rank == 0 else last}, rank, [0, 1], None,
                         torch.device("cpu"), 8)
    losses: list[float] = []

    def loss_fn(logits, y):
        loss = cross_entropy(logits, y)
        losses.append(float(loss))
        return loss

    batches = step_batches(0, 2)
    rt.run(schedule, batches, loss_fn)
    with torch.no_grad():
        want = [float(cross_entropy(last(first(x)), y)) for x, y in batches]
    return [losses, want] if rank == 1 else []


@pytest.mark.multiprocess
def test_each_activation_lands_on_its_micro_batch():
    losses, want = run_ranks(_crossed_receives, 2)[1]
    assert len(losses) == 2 and losses[0] != losses[1]
    # The same modules on the same activations: bitwise, whatever arrived first.
    assert losses == want


# ---------------------------------------------------------------------------------------------
# What the runtime promises about precision, memory and overlap (its module docstring).


class _Bf16Out(torch.nn.Module):
    """A first stage whose output is bf16, as autocast can make it."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        return self.inner(tokens).to(torch.bfloat16)


class _TrackedHead(torch.nn.Module):
    """A last stage that records what it receives: dtypes and values, how many received
    activations are still alive when each backward reaches its input, and how many forwards
    had run when each input's receive was posted (from a wrapped batch_isend_irecv)."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head
        self.reset()

    def reset(self) -> None:
        self.inputs: list = []  # weak references to every input received
        self.values: list[torch.Tensor] = []
        self.alive_at_backward: list[int] = []
        self.posted: list = []  # (weak reference to a receive buffer, forwards run by then)
        self.posted_ahead: list[tuple[int, int]] = []  # (forward index, forwards at posting)

    def forward(self, x):
        index = len(self.inputs)
        for buffer, forwards in self.posted:
            if buffer() is x:
                self.posted_ahead.append((index, forwards))
        self.inputs.append(weakref.ref(x))
        self.values.append(x.detach().clone())
        if x.requires_grad:
            x.register_hook(lambda g: self.alive_at_backward.append(
                sum(r() is not None for r in self.inputs)))
        return self.head(x)


def _runtime_promises() -> dict | None:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    first, head = _Embed(), _TrackedHead(torch.nn.Linear(8, VOCAB))
    cpu = torch.device("cpu")
    out = {}
    if rank == 1:  # record every receive buffer this rank posts, with the forwards run by then
        post = torch.distributed.batch_isend_irecv

        def recording(ops):
            head.posted += [(weakref.ref(op.tensor), len(head.inputs)) for op in ops
                            if op.op is torch.distributed.irecv]
            return post(ops)

        torch.distributed.batch_isend_irecv = recording
    # Activations travel in fp32, whatever the stage made (here bf16).
    rt = PipelineRuntime({rank: _Bf16Out(first) if rank == 0 else head}, rank, [0, 1], None,
                         cpu, 8)
    batches = step_batches(0, 2)
    rt.run(build_schedule("gpipe", 2, 2), batches, cross_entropy, scale=0.5)
    if rank == 1:
        with torch.no_grad():
            want = [first(x).to(torch.bfloat16).float() for x, _ in batches]
        out["wire"] = [(v.dtype, torch.equal(v, w)) for v, w in zip(head.values, want,
                                                                   strict=True)]
    # Received activations are released when their backward is done; receives are posted one
    # communication batch ahead.
    rt = PipelineRuntime({rank: first if rank == 0 else head}, rank, [0, 1], None, cpu, 8)
    batches = step_batches(0, 6)
    for name in ("1f1b", "gpipe"):
        head.reset()
        rt.run(build_schedule(name, 2, 6), batches, cross_entropy, scale=1 / 6)
        out[name] = dict(alive=head.alive_at_backward, ahead=head.posted_ahead)
    return out if rank == 1 else None


@pytest.fixture(scope="module")
def runtime_promises() -> dict:
    return run_ranks(_runtime_promises, 2)[1]


@pytest.mark.multiprocess
def test_activations_travel_in_fp32(runtime_promises):
    """A bf16 stage output arrives as fp32 holding exactly the bf16 values."""
    assert runtime_promises["wire"] == [(torch.float32, True)] * 2


@pytest.mark.multiprocess
def test_received_activations_are_freed_when_their_backward_is_done(runtime_promises):
    """On the last stage 1F1B holds one micro-batch's activation at a time: when backward
    reaches an input, no earlier input is alive. GPipe holds all m at the turn (the count sees
    them), then lets them go as backward proceeds (the runtime's loop variable keeps the
    previous input until the next backward has run, which 1F1B's alternation hides)."""
    assert runtime_promises["1f1b"]["alive"] == [1] * 6
    alive = runtime_promises["gpipe"]["alive"]
    assert alive[0] == 6 and alive == sorted(alive, reverse=True) and alive[-1] <= 2, alive


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_receives_are_posted_ahead_of_the_compute_before_them(runtime_promises, schedule):
    """Every forward input after the first was received into a buffer posted before the
    previous forward ran, so its transfer overlapped that compute."""
    ahead = runtime_promises[schedule]["ahead"]
    assert [k for k, _ in ahead] == list(range(6))
    assert all(posted_at < k for k, posted_at in ahead[1:]), ahead
