"""The WideResNet (``slapo.vision``) and its ready schedule: checkpointing gives the unscheduled
model's loss, gradients and BatchNorm running statistics in one process; tensor parallelism on 2
gloo ranks gives the same loss, each gradient and running statistic (or its slice), the same SGD
loss curve, checkpoints that load and gather whole, and a consolidated meta-device model equal to
one process's; unsupported knobs and widths that do not divide raise typed errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from wideresnet_jobs import DEPTH, WIDEN, assert_state, batch, models, tp_job

import slapo
from dist_utils import assert_check, check_all, run_workers
from slapo.model_schedule import apply_schedule, list_families
from slapo.model_schedule.wideresnet import shard_block
from slapo.vision import WideResNet, WideResNetConfig, wideresnet_loss

TP_CHECKS = [
    "one step, recommended knobs",
    "one step, no checkpoint",
    "one step, checkpointed",
    "one step, selective checkpoint",
    "sgd loss curve",
    "checkpoint round trip",
    "meta init",
]


# ----- the model -----------------------------------------------------------------------------
def test_wideresnet_follows_the_paper_layout():
    model = WideResNet(depth=16, widen_factor=4, num_classes=7)
    assert model.config.model_type == "wideresnet" and "wideresnet" in list_families()
    assert model.config.widths == (16, 64, 128, 256)
    assert [len(g) for g in (model.layer1, model.layer2, model.layer3)] == [2, 2, 2]
    # A projection shortcut exactly where the width or the stride changes.
    blocks = [*model.layer1, *model.layer2, *model.layer3]
    assert [b.shortcut is not None for b in blocks] == [True, False, True, False, True, False]
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 7)


@pytest.mark.parametrize(
    "kwargs", [{"depth": 12}, {"depth": 4}, {"widen_factor": 0}, {"dropout": 1.0}]
)
def test_wideresnet_config_refuses_bad_sizes(kwargs):
    with pytest.raises(slapo.SlapoError, match="WideResNet: "):
        WideResNetConfig(**kwargs)


# ----- one process ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [None, "save_matmuls"])
def test_checkpointed_schedule_matches_the_unscheduled_model(policy):
    ref, model = models(ckpt_ratio=1.0, ckpt_policy=policy)
    for step in range(2):
        images, labels = batch(step)
        for mod in (ref, model):
            mod.zero_grad(set_to_none=True)
        ref_loss = wideresnet_loss(ref, images, labels)
        loss = wideresnet_loss(model, images, labels)
        ref_loss.backward()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        # The recompute in backward must not update the running statistics a second time.
        assert_state(model, ref)
    assert model.layer1[0].bn2.num_batches_tracked.item() == 2


@pytest.mark.parametrize("momentum", [0.1, None])  # None: a cumulative average
def test_checkpoint_primitive_updates_batchnorm_statistics_once(momentum):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())
    model = copy.deepcopy(ref)
    slapo.create_schedule(model)["1"].checkpoint()
    x = torch.randn(2, 3, 6, 6)
    for mod in (ref, model):
        for _ in range(2):
            mod(x).sum().backward()
    for got, want in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"attn_op": "sdpa"}, "attn_op is not supported: a WideResNet has no attention"),
        ({"fuse_ops": True}, "fuse_ops is not supported: "),
        ({"fused_loss": True}, "fused_loss is not supported: "),
        ({"compile_model": True}, "compile_model is not supported: .* use compile_blocks=True"),
        ({"num_stages": 2, "ckpt_ratio": 0.0}, "num_stages is not supported: pipeline stages"),
    ],
)
def test_knobs_without_meaning_for_a_cnn_raise(knobs, match):
    with pytest.raises(slapo.SlapoError, match=match):
        apply_schedule(WideResNet(depth=DEPTH, widen_factor=WIDEN), **knobs)


def test_width_not_dividing_the_group_size_names_the_module():
    # The check comes before any sharding, so no process group is needed to see it.
    sch = slapo.create_schedule(WideResNet(depth=DEPTH, widen_factor=WIDEN))
    with pytest.raises(slapo.SlapoError, match='over 3 ranks: "layer1.0.conv1" has 32 output'):
        shard_block(sch, "layer1.0", 3)


def test_recommended_schedule_applies_to_a_wideresnet():
    sch = apply_schedule(WideResNet(depth=DEPTH, widen_factor=WIDEN))  # no knobs
    assert sch.extra["model_schedule"]["ckpt_ratio"] == 0.5


# ----- tensor parallelism (2 gloo ranks) ------------------------------------------------------
@pytest.fixture(scope="module")
def tp_reports(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("wrn") / "ckpt")
    return check_all(run_workers(tp_job, 2, args=(directory,), deadline=120.0))


@pytest.mark.parametrize("check", TP_CHECKS)
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_tensor_parallel_schedule_matches_one_process(tp_reports, check):
    assert_check(tp_reports, check)
