"""ModelExecutePlan.auto over several models: one plan per model, cut against one target."""

from __future__ import annotations

import doctest

import pytest
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe
from roundpipe.runtime import plan as plan_module


class _Timer:
    def __init__(self, fwd: list[float]) -> None:
        self.fwd = fwd

    def get_estimate(self, run_type: str):
        return "time", list(self.fwd), [3.0 * v for v in self.fwd]


class _Model:
    """A PipelineModel with given layer times (ms) and sizes (bytes)."""

    def __init__(self, fwd: list[float], nbytes: int = 1000) -> None:
        self.name = "fake"
        self.num_layers = len(fwd)
        self.layers = [nn.Identity() for _ in fwd]
        self.layer_attrs: list = []
        self.layer_bytes = [nbytes] * len(fwd)
        self.layer_grad_bytes = [nbytes] * len(fwd)
        self.model_timer = _Timer(fwd)


@pytest.fixture
def one_device():
    roundpipe.init_devices(num_virtual=1)
    yield


def test_one_model_gets_its_plan_itself(one_device):
    plan = ModelExecutePlan.auto("fused", _Model([1.0] * 4))
    assert isinstance(plan, ModelExecutePlan)
    assert plan.fwd_plan == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_several_models_get_one_plan_each_against_one_target(one_device, run_type):
    fast, slow = _Model([1.0] * 8), _Model([2.0] * 3)  # different layer counts
    plans = ModelExecutePlan.auto(run_type, fast, slow)
    assert isinstance(plans, tuple) and len(plans) == 2
    for plan, model in zip(plans, (fast, slow)):
        plan.check_valid(model.num_layers, run_type)
    # the target is 1.1x the slowest layer of either model (2 ms): the fast model's stages take
    # two of its layers, as long as one stage of the slow model; alone, it gets one per stage
    alone = ModelExecutePlan.auto(run_type, fast)
    assert plans[0].fwd_plan == [range(i, i + 2) for i in range(0, 8, 2)]
    assert alone.fwd_plan == [range(i, i + 1) for i in range(8)]
    assert plans[1].fwd_plan == [range(i, i + 1) for i in range(3)]
    if run_type != "infer":
        assert plans[0].bwd_plan == [range(i, i + 2) for i in range(6, -1, -2)]


def test_the_common_target_is_lowered_until_every_model_has_min_stages(one_device):
    a, b = _Model([1.0] * 6), _Model([1.0] * 2)
    pa, pb = ModelExecutePlan.auto("train", a, b, min_stages=3, upper_threshold=10.0)
    assert len(pa.fwd_plan) >= 3 and len(pb.fwd_plan) == 2  # b has only two layers
    assert len(pa.bwd_plan) >= 3


def test_auto_with_real_models_in_order(two_devices):
    a = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), pin_model="off")
    b = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]), pin_model="off")
    pa, pb = ModelExecutePlan.auto("fused", a, b)
    pa.check_valid(4, "fused")
    pb.check_valid(2, "fused")
    assert ModelExecutePlan.auto("fused", b, a) == (pb, pa)


def test_auto_needs_a_model():
    with pytest.raises(ValueError, match="at least one model"):
        ModelExecutePlan.auto("fused")


def test_plan_docstring_examples(two_devices):
    result = doctest.testmod(plan_module)
    roundpipe.init_devices(num_virtual=2)
    assert result.attempted > 0 and result.failed == 0
