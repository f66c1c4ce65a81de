"""Load balance of the MoE router after 200 steps (slow; single process): the Switch
auxiliary loss, or DeepSeek-V3's routing bias, keeps the busiest expert of every MoE layer under
1.5x the mean load; without either, the imbalance is shown (above 1.5x in some layer).
The aux coefficient is 0.1 here: at Switch's 0.01 this tiny, short run ends at 1.45 (measured),
too close to the line to call it kept under; the bias needs no coefficient."""

from __future__ import annotations

import pytest
import torch

from tessera.config_io import make_config
from tessera.data.loader import BatchLoader, TokenDataset
from tessera.moe import moe_layers
from tessera.step import build_executor
from tessera.topology import Topology

STEPS, LAST = 200, 20


def _busiest_over_mean(tiny_data: str, **moe) -> float:
    """Train a tiny MoE STEPS steps; the largest busiest/mean load ratio over its MoE layers,
    counted over the last LAST steps."""
    cfg = make_config("tiny", overrides=[f"data.path={tiny_data}", "data.seq_len=32"],
                      model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 moe_experts=8, moe_top_k=2, moe_ffn_hidden=32, **moe),
                      train=dict(micro_batch_size=8, lr=3e-3, steps=STEPS))
    executor = build_executor(cfg, Topology.build(cfg.parallel), torch.device("cpu"))
    opt = executor.optimizer(cfg.train)
    dataset = TokenDataset(cfg.data.path)
    loader = BatchLoader(dataset.train, cfg.data.seq_len, cfg.train.micro_batch_size, 1, 0, 1,
                         cfg.data.seed)
    layers = [m for c in executor.model.chunks.values() for m in moe_layers(c)]
    for step in range(STEPS):
        if step == STEPS - LAST:
            for m in layers:
                m.stats.reset()
        executor.train_step(loader, opt, grad_clip=cfg.train.grad_clip)
    loads = [m.stats.tokens_per_expert for m in layers]
    return max(float(load.max() / load.mean()) for load in loads)


@pytest.mark.slow
def test_balancing_keeps_the_busiest_expert_under_one_and_a_half_times_the_mean(tiny_data):
    free = _busiest_over_mean(tiny_data, moe_aux_loss_coef=0.0)
    aux = _busiest_over_mean(tiny_data, moe_aux_loss_coef=0.1)
    bias = _busiest_over_mean(tiny_data, moe_aux_loss_coef=0.0, moe_router_bias_rate=1e-3)
    print(f"busiest/mean after {STEPS} steps: no balancing {free:.2f}, aux loss {aux:.2f}, "
          f"routing bias {bias:.2f}")
    assert free > 1.5, free
    assert aux < 1.5, aux
    assert bias < 1.5, bias
