"""titan_mok.time_share on modules of known duration: each category's forward, backward and,
under activation checkpointing, its recompute, with the recompute that runs inside another
category's backward taken off that one."""

import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchtitan.models.moe import MoE as TorchTitanMoE
from torchtitan.models.moe import MoEArgs as TorchTitanMoEArgs

from titan_mok.moe import MoE, MoEArgs
from titan_mok.time_share import TimeShare, category_of

ATTENTION_FWD, ATTENTION_BWD, MOE_FWD, MOE_BWD = 0.05, 0.03, 0.02, 0.06
"""Seconds each stand-in sleeps."""
LAYERS = 2


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x_BSH):
        return _Sleep.apply(x_BSH * self.w, ATTENTION_FWD, ATTENTION_BWD)  # the product saves x for backward


class _SleepyMoE(MoE):
    def forward(self, x_BSH):
        # a product after the sleep saves a tensor, so that a recompute runs through the sleep
        # (it stops after the last op that saves one: checkpoint's early stop)
        w_H = self.router.gate.weight[0]
        return _Sleep.apply(x_BSH * w_H, MOE_FWD, MOE_BWD) * w_H


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention()
        self.moe = _SleepyMoE(MoEArgs(num_experts=2, top_k=1, expert_dim=4), dim=4)

    def forward(self, x_BSH):
        h_BSH = x_BSH + self.attention(x_BSH)
        return h_BSH + self.moe(h_BSH)


class _Model(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(LAYERS)})
        self.recompute = recompute

    def forward(self, x_BSH):
        for block in self.layers.values():
            x_BSH = checkpoint(block, x_BSH, use_reentrant=False) if self.recompute else block(x_BSH)
        return x_BSH


@pytest.mark.parametrize("recompute", [False, True], ids=["no_ac", "full_ac"])
def test_shares_count_forward_backward_and_recompute(recompute):
    model = _Model(recompute)
    share = TimeShare([model])
    assert share.timed == {"moe": ["layers.0.moe", "layers.1.moe"], "attention": ["layers.0.attention", "layers.1.attention"]}
    model(torch.ones(1, 2, 4, requires_grad=True)).sum().backward()
    with torch.no_grad():  # not a training forward: counts nothing
        model(torch.ones(1, 2, 4))
    seconds = share.collect(interval_s=1.0)
    runs = 2 if recompute else 1  # forwards per step
    expected = {"moe/time_share": LAYERS * (runs * MOE_FWD + MOE_BWD),
                "attention/time_share": LAYERS * (runs * ATTENTION_FWD + ATTENTION_BWD)}
    assert set(seconds) == set(expected)
    # under AC the MoE's recompute runs inside its own backward; the attention's too, and is taken off it
    for key, value in expected.items():
        # sleeps last at least their time; the slack stays under the attention recompute (0.1 s over both layers)
        # that the MoE's backward would hold if it were not taken off
        assert value - 1e-3 <= seconds[key] <= value + 0.04, (key, seconds)
    assert share.collect(interval_s=1.0) == {"moe/time_share": 0.0, "attention/time_share": 0.0}
    share.remove()


def test_categories_and_compiled_modules_left_out():
    moe = TorchTitanMoE(TorchTitanMoEArgs(num_experts=2, top_k=1), dim=4, hidden_dim=8)
    assert category_of("layers.0.moe", moe) == "moe"
    assert category_of("layers.3.linear_attention", nn.Linear(2, 2)) == "attention"
    assert category_of("layers.3.attention.wq", nn.Linear(2, 2)) is None

    model = _Model(recompute=False)
    model.layers["1"] = torch.compile(model.layers["1"])  # a block compiled whole: its parts run in its graph
    share = TimeShare([model])
    assert share.left_out == {"moe": ["layers.1._orig_mod.moe"], "attention": ["layers.1._orig_mod.attention"]}
    assert share.collect(interval_s=1.0) == {}  # a share over part of the modules would mislead
    share.remove()

    model = _Model(recompute=False)
    model.layers["0"].attention = torch.compile(model.layers["0"].attention)  # compiled itself: timed around
    share = TimeShare([model])
    assert share.timed["attention"] == ["layers.0.attention", "layers.1.attention"] and not share.left_out["attention"]
    share.remove()
