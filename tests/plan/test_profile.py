"""The planner's depth extension (slapo.plan.profile) equals the fake step of the whole model.

Fake steps of two and three layers, extended linearly to the model's depth, must give what the fake
step of every layer gives: memory (activations, the forward's and backward's peaks, what each
pipeline stage and FSDP rank holds) and work (FLOPs, bytes, collectives), for the layouts the
planner ranks: FSDP in bf16, a pipeline of 2 stages, tensor and context parallelism.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from slapo.memory import fake_layout_groups
from slapo.plan.profile import (
    DEPTHS,
    _fake_step,
    _profiled_depths,
    _rank_groups,
    extend_to_depth,
    layer_list_path,
    model_shape,
    profile_config,
    shallow_configs,
)
from slapo.plan.step_time import PlanError
from slapo.train.config import TrainConfig
from slapo.train.run_memory import estimate_config, layout_spec

pytest.importorskip("transformers")

LAYOUTS = {
    "fsdp dp8 bf16": (dict(target="fsdp", precision="bf16"), 8),
    "pipeline pp2 x4 fsdp dp2": (
        dict(target="fsdp", precision="bf16", pp=2, num_microbatches=4, batch_size=4),
        2,
    ),
    "ddp tp2 fp32": (dict(target="ddp", precision="fp32", tp=2), 2),
    "fsdp cp2 bf16": (dict(target="fsdp", precision="bf16", cp=2), 2),
    # half the blocks checkpointed: the layers differ, so the whole depth is profiled
    "ddp half checkpointed fp32": (dict(target="ddp", precision="fp32", ckpt_ratio=0.5), 2),
}


def _cfg(model: str, **fields) -> TrainConfig:
    base = dict(
        model=model, device="cuda", seq_len=64, batch_size=2, ckpt_ratio=1.0,
        ckpt_policy="save_matmuls", progress=False,
    )  # fmt: skip
    return TrainConfig(**{**base, **fields})


def _whole(cfg: TrainConfig, dp: int):
    """The whole model's estimate (every stage; the one needing most) and counts."""
    spec = layout_spec(cfg, 0, dp)
    estimates = [
        estimate_config(cfg, rank=s * spec.cp * spec.tp, dp=dp) for s in sorted({0, spec.pp - 1})
    ]  # fmt: skip
    _, counts = _fake_step(cfg, spec, (torch.optim.AdamW, {"lr": cfg.lr}))
    return max(estimates, key=lambda e: e.reserved), counts


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_extension_equals_the_whole_models_fake_step(small_llama: str, name: str) -> None:
    fields, dp = LAYOUTS[name]
    cfg = _cfg(small_llama, **fields)
    whole, counts = _whole(cfg, dp)
    config = json.loads((Path(small_llama) / "config.json").read_text())
    with shallow_configs(config) as shallow:
        profile = profile_config(cfg, layout_spec(cfg, 0, dp), shallow, 4)
    got = profile.estimate
    # a pipeline's fake step saves the token ids of a microbatch that is a view of the whole
    # batch: its embedding counts the batch's storage; the profile's fake step runs the
    # microbatch alone. Those bytes (the batch is held anyway) are all that may differ.
    ids = 8 * cfg.batch_size * cfg.seq_len * cfg.pp if cfg.pp > 1 else 8
    for part in ("params", "grads", "optimizer_state", "activations", "engine", "live_peak"):
        assert getattr(got, part) == pytest.approx(getattr(whole, part), rel=1e-6, abs=ids), part
    assert got.reserved == pytest.approx(whole.reserved, rel=1e-6, abs=2 * 2**20)
    # the work: a microbatch of the whole model (pp > 1: the fake step runs one)
    if cfg.pp == 1:
        assert profile.counts.flops == counts.flops
        for phase, nbytes in counts.memory_bytes.items():
            assert profile.counts.memory_bytes[phase] == pytest.approx(nbytes, rel=1e-6)
        assert profile.counts.collectives.keys() == counts.collectives.keys()
        assert profile.counts.selective_ops == counts.selective_ops


def test_some_blocks_checkpointed_profile_the_whole_depth(small_llama: str) -> None:
    # ceil(0.5 x 4) = 2 of 4 blocks: two and three layers (1 and 2 checkpointed) cannot say
    # one layer of each kind; all or none checkpointed can
    cfg = _cfg(small_llama, ckpt_ratio=0.5)
    assert _profiled_depths(cfg, 4) == (4,)
    assert _profiled_depths(_cfg(small_llama, ckpt_ratio=1.0), 4) == DEPTHS
    assert _profiled_depths(_cfg(small_llama, ckpt_ratio=0.0), 4) == DEPTHS
    half = profile_config(cfg, layout_spec(cfg, 0, 1), {}, 4)
    full = _cfg(small_llama, ckpt_ratio=1.0)
    config = json.loads((Path(small_llama) / "config.json").read_text())
    with shallow_configs(config) as shallow:
        every = profile_config(full, layout_spec(full, 0, 1), shallow, 4)
    # half the blocks pass through the checkpoint's mode
    for phase, ops in every.counts.selective_ops.items():
        assert half.counts.selective_ops[phase] == ops // 2


def test_each_peak_is_extended_on_its_own(small_llama: str) -> None:
    # The forward's peak (its end: autocast still caches a 16-bit copy of every weight) and the
    # backward's (the loss's float32 logits, or later with gradients) grow with depth at their
    # own rates: which one is a deep model's peak follows from each extended apart (at 70B
    # the forward's overtakes the loss's after about 16 layers).
    config = json.loads((Path(small_llama) / "config.json").read_text())
    cfg = _cfg(small_llama, precision="bf16", target="eager", ckpt_policy="full")
    spec = layout_spec(cfg, 0, 1)
    optimizer = (torch.optim.AdamW, {"lr": cfg.lr})
    with shallow_configs(config) as shallow:
        two, three = (
            _fake_step(dataclasses.replace(cfg, model=shallow[d]), spec, optimizer)[0]
            for d in (2, 3)
        )  # fmt: skip
    forward = three.forward_peak - two.forward_peak
    backward = three.backward_peak - two.backward_peak
    assert forward != backward
    deep = extend_to_depth(two, three, 400, "model.layers")
    assert deep.forward_peak == two.forward_peak + 398 * forward
    assert deep.backward_peak == two.backward_peak + 398 * backward
    assert deep.live_peak >= max(deep.forward_peak, deep.backward_peak)


def test_shapes_and_layer_lists(small_llama: str) -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 96, "n_layer": 3, "n_head": 4, "vocab_size": 256}
    shape = model_shape(gpt2)
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (
        96, 3, 384,
    )  # fmt: skip
    with shallow_configs(gpt2) as shallow:
        two = json.loads((Path(shallow[2]) / "config.json").read_text())
    assert two["n_layer"] == 2
    with pytest.raises(PlanError, match="at least 2 layers"):
        with shallow_configs({**gpt2, "n_layer": 1}):
            pass
    with pytest.raises(PlanError, match="no list of 7 layers"):
        layer_list_path(torch.nn.Linear(2, 2), 7)


def test_rank_groups_are_those_of_the_estimate(small_llama: str) -> None:
    cfg = _cfg(small_llama, tp=2, cp=2)
    spec = layout_spec(cfg, 0, 1)
    with _rank_groups(cfg, spec) as (layout, groups):
        assert layout.tp_size == 2 and groups["cp"].size() == 2
    with fake_layout_groups(tp=2) as groups:  # nothing left behind: a new fake world starts
        assert groups["tp"].size() == 2
