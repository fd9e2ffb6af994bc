"""One source of truth for `slapo train`'s targets and knobs: --target's choices are the registered
build targets the main job has a TargetUse for, what a target needs from the main job is a
TargetUse field (no target named anywhere else in slapo.train), and the knob flags are the
schedule's Knobs with the registries' choices."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

import slapo.train
from slapo.model_schedule import ATTN_OPS, CKPT_POLICIES, LAYOUT_KNOBS, Knobs
from slapo.primitives.compile_rng import RNG_MODES
from slapo.targets import list_targets
from slapo.train import InputError, TrainConfig
from slapo.train.config import SCHEDULE_KNOBS, knob_fields
from slapo.train.job_layout import build_target, schedule_knobs
from slapo.train.run_memory import layout_spec
from slapo.train.uses import (
    TARGET_USES,
    replica_engine,
    run_target,
    staged_target,
    target_choices,
)

TRAIN = Path(slapo.train.__file__).resolve().parent


def _meta(name: str) -> dict:
    return next(f.metadata for f in fields(TrainConfig) if f.name == name)


def test_target_choices_are_the_registry_and_the_uses(monkeypatch):
    assert set(target_choices()) == set(list_targets()) & set(TARGET_USES)
    assert _meta("target")["choices"] == target_choices() == slapo.train.TARGETS
    assert TrainConfig().target in target_choices()
    # a target the registry lacks is no choice, though the main job knows how to use it
    from slapo.targets import target_registry as registry

    monkeypatch.delitem(registry._TARGETS, "deepspeed")
    assert "deepspeed" not in target_choices() and "deepspeed" in TARGET_USES
    with pytest.raises(InputError, match="--target must be one of"):
        TrainConfig(target="no-such-target").check()


def test_the_build_target_and_engine_come_from_the_uses(monkeypatch):
    assert staged_target() == "pipeline" and TARGET_USES["pipeline"].stages
    assert [run_target(t, 1, 1) for t in TARGET_USES] == list(TARGET_USES)
    assert run_target("eager", 1, 2) == TARGET_USES["eager"].replicas == "ddp"
    assert {run_target(t, 2, 2) for t in TARGET_USES} == {"pipeline"}
    assert replica_engine("eager", 2, 2) == "ddp" and replica_engine("fsdp", 1, 2) == "fsdp"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert build_target(TrainConfig(tp=2)) == "ddp"  # 2 replicas of an eager run
    assert build_target(TrainConfig(tp=4)) == "eager"
    assert layout_spec(TrainConfig(pp=2, target="fsdp"), dp=2).target == "fsdp"
    assert layout_spec(TrainConfig(pp=2), dp=1).target == "pipeline"
    assert layout_spec(TrainConfig(), dp=2).target == "ddp"


def test_what_a_target_needs_is_a_target_use_field():
    assert all(use.checkpoint == "full" for use in TARGET_USES.values())  # every --save is HF
    assert not TARGET_USES["pipeline"].baseline and TARGET_USES["eager"].baseline
    assert [t for t, u in TARGET_USES.items() if u.whole_estimate] == ["eager"]
    assert schedule_knobs(TrainConfig())["compile_model"]  # recommended where it was measured
    assert not schedule_knobs(TrainConfig(target="fsdp"))["compile_model"]
    with pytest.raises(Exception, match="--pp supports"):
        TARGET_USES["pipeline"].check(TrainConfig(model="bert", pp=2))


def test_no_target_is_named_outside_the_uses():
    """No string in slapo/train's code (docstrings aside) is a target's name, but in uses.py."""
    named = []
    for path in sorted(TRAIN.glob("*.py")):
        if path.name == "uses.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in TARGET_USES:
                named.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not named, named


def test_knob_flags_are_the_schedule_knobs_with_the_registries_choices():
    knobs = {f.name for f in fields(Knobs)}
    assert set(knob_fields()) == knobs - {"group", "num_stages"}  # the mesh, and --pp
    assert set(LAYOUT_KNOBS) - set(knob_fields()) == {"group", "num_stages"}
    assert all(_meta(name)["group"] == SCHEDULE_KNOBS for name in knob_fields())
    assert _meta("ckpt_policy")["choices"] == CKPT_POLICIES
    assert _meta("compile_rng")["choices"] == RNG_MODES
    assert set(_meta("attn_op")["choices"]) == {"model", *ATTN_OPS}
    with pytest.raises(InputError, match="--ckpt-policy must be one of"):
        TrainConfig(ckpt_policy="everything").check()
    # every knob flag reaches the schedule
    given = {"ckpt_ratio": 0.5, "ckpt_policy": "full", "compile_blocks": True,
             "compile_model": False, "compile_rng": "inductor", "attn_op": "eager",
             "fuse_ops": True, "fused_loss": True, "sequence_parallel": False}  # fmt: skip
    assert set(given) == set(knob_fields())
    knobs_of_run = schedule_knobs(TrainConfig(**given))
    assert {k: knobs_of_run[k] for k in given} == given


def test_every_target_has_one_record_the_run_and_the_planner_read():
    """Each registered target's record says what the main job and the planner need: its
    memory model is one the planner has, its precisions are the three; the resolved run reads
    placement from it (RoundPipe's batches stay on the host)."""
    from slapo.memory.targets import ENGINE_MODELS, LAYOUT_TARGETS
    from slapo.precision import PRECISIONS
    from slapo.targets import get_record, list_targets
    from slapo.train import TrainConfig
    from slapo.train.run import resolve_run

    assert set(LAYOUT_TARGETS) == set(ENGINE_MODELS)
    for name in list_targets():
        record = get_record(name)
        assert record.memory in ENGINE_MODELS and record.precisions == PRECISIONS, name
    assert get_record("ddp").distributed and not get_record("eager").distributed
    assert resolve_run(TrainConfig(target="roundpipe")).batch_device.type == "cpu"
    assert "device" not in resolve_run(TrainConfig(target="roundpipe")).build_options()


def test_a_target_registered_without_precisions_refuses_bf16_by_name():
    import torch

    import slapo
    from slapo.exceptions import TargetError
    from slapo.targets import target_registry as registry

    @registry.register_target("plain_test_target")
    def build_plain(sch, **options):
        return sch.mod, None

    try:
        sch = slapo.create_schedule(torch.nn.Linear(2, 2))
        with pytest.raises(TargetError, match='"plain_test_target" trains in fp32, not bf16'):
            slapo.build(sch, target="plain_test_target", precision="bf16")
        assert slapo.build(sch, target="plain_test_target")[1] is None
    finally:
        del registry._TARGETS["plain_test_target"]
