"""``slapo tune --predict``'s predictor for ``slapo train`` commands, which the planner
registers with the tuner (slapo.plan.tune_predictor)."""

from __future__ import annotations

import pytest

from slapo.plan.hardware import PRESETS, DeviceSpecError, save_device
from slapo.plan.tune_predictor import device_named
from slapo.tune.predict import command_predictor

pytest.importorskip("transformers")


def test_devices_by_name_or_file(tmp_path) -> None:
    assert device_named("H100") == PRESETS["h100-sxm"]
    path = save_device(PRESETS["h200"], tmp_path / "mine.json")
    assert device_named(str(path)) == PRESETS["h200"]
    with pytest.raises(DeviceSpecError, match="nowhere.json"):
        device_named(str(tmp_path / "nowhere.json"))


def test_the_planner_predicts_slapo_train_trials_on_the_named_device() -> None:
    found = command_predictor(["slapo", "train", "--model", "llama", "--steps", "2"], "h200")
    assert found is not None
    predict, capacity = found
    assert capacity == int(PRESETS["h200"].hbm_gib * 2**30)
    full, none = predict({"ckpt_ratio": 1.0}), predict({"ckpt_ratio": 0.0})
    # full recompute runs the forward twice: slower, and holds fewer activations
    assert full.seconds > none.seconds and full.memory_bytes < none.memory_bytes
    assert command_predictor(["python", "train.py"], "h200") is None  # not slapo train
