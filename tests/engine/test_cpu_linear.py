"""The CPU decode-batch linear layer computes what nn.Linear computes, for every batch shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu_linear import SkinnyLinear, use_skinny_linear


@pytest.mark.parametrize("shape", [(1, 64), (8, 64), (1, 8, 64), (2, 16, 64), (1, 40, 64), (0, 64), (64,)])
@pytest.mark.parametrize("bias", [False, True])
def test_same_result_as_nn_linear(shape, bias):
    torch.manual_seed(0)
    ref = nn.Linear(64, 300, bias=bias)
    fast = nn.Linear(64, 300, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert use_skinny_linear(fast) == 1 and isinstance(fast, SkinnyLinear)
    x = torch.randn(shape)
    got, want = fast(x), ref(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_plain_linear_layers_switch_and_weights_stay():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.ReLU(), nn.Linear(4, 2))
    w = model[0].weight
    assert use_skinny_linear(model) == 2
    assert type(model[1]) is Custom and model[0].weight is w
    assert use_skinny_linear(model) == 0  # idempotent


def test_cpu_float32_engine_uses_it_for_the_output_projection_only(make_engine):
    eng = make_engine("tiny")
    if eng.loaded.device.type != "cpu":
        pytest.skip("CPU only")
    model = eng.runner.model
    assert isinstance(model.lm_head, SkinnyLinear)
    body = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert body and not any(isinstance(m, SkinnyLinear) for m in body)
