"""The step the DP-cost probe times (benchmarks/dp_cost.py): its ``--grads-in-place`` mode
must measure what it says, gradients that live in DDP's buckets and are zeroed in place, not
a copy and not gradients summed over steps; its ``--aa shared-params`` A/A must run two
models on one set of weights, each with its own gradients and optimizer state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from dp_cost import share_parameters, timed_step  # noqa: E402

from tessera.parallel.ddp import DataParallel  # noqa: E402


class _Executor:
    """The part of tessera.step.Executor that timed_step uses: one backward of a fixed loss."""

    last_comm_wait_s = 0.0
    last_record = None

    def __init__(self, model: nn.Module):
        self.model = model

    def forward_backward(self, batches):
        x, y = batches[0]
        nn.functional.mse_loss(self.model(x), y).backward()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return 0.0


def test_grads_in_place_keeps_bucket_views_and_zeroes_them_each_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapper = DataParallel(model, None)  # one rank: the buckets, no hooks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: same grads
    batch = (torch.randn(5, 8), torch.randn(5, 4))
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # a second step would double the gradients if the zeroing were missing
        timed_step(_Executor(model), optimizer, batch, 1.0, in_place=(wrapper,))
    views = {id(p): v for b in wrapper.buckets for p, v in zip(b.params, b.views, strict=True)}
    for name, p in model.named_parameters():
        assert p.grad.data_ptr() == views[id(p)].data_ptr(), name  # added into its slot
        # One backward of the same float32 ops into a zeroed slot: 0 + g is exact.
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)


def test_shared_params_share_the_weights_not_the_gradients_or_optimizer_state():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.manual_seed(1)
    b = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1)  # before sharing, as dp_cost builds it
    share_parameters(b, a)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pb.data_ptr() == pa.data_ptr()  # one storage: where the weights live is shared
    before = [p.detach().clone() for p in a.parameters()]
    batch = (torch.randn(5, 8), torch.randn(5, 4))
    timed_step(_Executor(b), opt_b, batch, 1.0)
    # b's step moved a's weights (they are one tensor), through b's own optimizer state ...
    assert all(not torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))
    assert all(p.grad is None for p in a.parameters())  # ... and b's own gradients
    assert all(p.grad is not None for p in b.parameters())
    own = {id(p) for p in b.parameters()}  # b's Parameter objects, not a's, hold the state
    assert opt_b.state and all(id(p) in own for p in opt_b.state)
    assert not any(id(p) in own for p in a.parameters())


def test_aa_modes_other_than_built_need_same():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dp_cost.py"
    res = subprocess.run([sys.executable, str(script), "--aa", "one-model"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--aa one-model needs --same" in res.stderr, res.stderr
