"""``plan_layouts``: every layout enumerated, the ones that fit ranked, their commands exact."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from slapo.plan.hardware import PRESETS, ClusterSpec, DeviceSpec
from slapo.plan.profile import model_shape
from slapo.plan.search import (
    AC_CHOICES,
    candidate_layouts,
    parse_layout,
    plan_layouts,
    predict_config,
)
from slapo.plan.step_time import PlanError
from slapo.train import add_parser as add_train
from slapo.train.config import TrainConfig
from slapo.train.train_cli import config_from_args

pytest.importorskip("transformers")


def _cluster(hbm_gib: float = 80.0) -> ClusterSpec:
    device = dataclasses.replace(PRESETS["h100-sxm"], hbm_gib=hbm_gib)
    return ClusterSpec(device, gpus_per_node=4, inter_node_gbps=50.0)


def test_parse_layout() -> None:
    assert parse_layout("fsdp=32,tp=8") == {"target": "fsdp", "dp": 32, "tp": 8}
    got = parse_layout("dp=8, pp=8, tp=8, schedule=1f1b, microbatches=32, ac=full")
    assert got == {
        "dp": 8, "pp": 8, "tp": 8, "pipeline_schedule": "1F1B", "num_microbatches": 32,
        "ac": "full",
    }  # fmt: skip
    for bad, words in [
        ("dp8", "name=value"), ("tp=0", "positive"), ("tp=two", "positive"),
        ("zz=2", "unknown"), ("schedule=interleaved-1f1b", "interleaved"), ("ac=most", "ac="),
    ]:  # fmt: skip
        with pytest.raises(PlanError, match=words):
            parse_layout(bad)


def test_candidates_cover_the_gpus_and_respect_the_models_shape(small_llama: str) -> None:
    shape = model_shape(json.loads((Path(small_llama) / "config.json").read_text()))
    base = TrainConfig(model=small_llama, seq_len=64, progress=False)
    seen = list(candidate_layouts(shape, base, 8, 4, 16, min_cp_chunk=16))
    assert {cfg.cp for cfg, _ in candidate_layouts(shape, base, 8, 4, 16)} == {1}  # 64 < 2048
    assert seen
    for cfg, dp in seen:
        assert dp * cfg.tp * cfg.pp * cfg.cp == 8 and 16 % dp == 0
        assert cfg.batch_size == 16 // dp
        assert shape["num_key_value_heads"] % cfg.tp == 0 and cfg.tp <= 4  # within a node
        assert cfg.cp == 1 or cfg.pp == 1  # slapo train refuses both
        assert cfg.ep == 1  # no experts
        if cfg.pp > 1:
            assert shape["num_hidden_layers"] % cfg.pp == 0
            assert cfg.num_microbatches == cfg.batch_size >= cfg.pp
    layouts = {(cfg.tp, cfg.pp, cfg.cp, cfg.target) for cfg, _ in seen}
    assert {(2, 1, 1, "fsdp"), (1, 2, 1, "ddp"), (1, 1, 2, "fsdp"), (2, 2, 1, "fsdp")} <= layouts
    assert all(tp <= 2 for tp, *_ in layouts)  # 2 key/value heads


@pytest.fixture(scope="module")
def plans(small_llama: str) -> list:
    """Every FSDP layout of the small model on 2 GPUs, shared by the tests below."""
    return plan_layouts(
        small_llama, _cluster(), gpus=2, seq_len=64, global_batch=4, keep_all=True,
        ac=("none", "full"), targets=("fsdp",), min_cp_chunk=16,
    )  # fmt: skip


def test_ranked_fastest_first_each_with_the_fastest_checkpointing_that_fits(plans: list) -> None:
    cluster = _cluster()
    fitting = [p for p in plans if p.fits]
    assert fitting and fitting == plans[: len(fitting)]
    speeds = [p.prediction.tokens_per_s_per_gpu for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    # a small model fits every way: the fastest checkpointing (none) is each one's choice
    assert {p.ac for p in fitting} == {"none"}
    best = fitting[0]
    again = predict_config(best.cfg, cluster, dp=best.dp)
    assert again.seconds == pytest.approx(best.prediction.seconds)
    assert again.memory_bytes == best.prediction.memory_bytes


def test_a_tight_budget_picks_more_recompute_and_drops_what_cannot_fit(small_llama: str) -> None:
    cluster = _cluster()
    roomy = plan_layouts(small_llama, cluster, gpus=1, seq_len=256, global_batch=8, ac=("none",))
    need = {p.ac: p.prediction.memory_bytes for p in roomy}
    full = plan_layouts(small_llama, cluster, gpus=1, seq_len=256, global_batch=8, ac=("full",))
    between = (need["none"] + full[0].prediction.memory_bytes) / 2
    tight = _cluster(hbm_gib=between / 2**30)
    chosen = plan_layouts(small_llama, tight, gpus=1, seq_len=256, global_batch=8)
    assert chosen and chosen[0].ac != "none" and chosen[0].fits
    assert plan_layouts(small_llama, _cluster(hbm_gib=1e-3), gpus=1, seq_len=256,
                        global_batch=8) == []  # fmt: skip


def test_the_command_parses_back_into_the_layout(plans: list) -> None:
    cluster = _cluster()
    shown = (
        plans[:3] + [p for p in plans if p.cfg.pp > 1][:1] + [p for p in plans if p.cfg.cp > 1][:1]
    )
    assert {p.cfg.pp > 1 for p in shown} == {True, False}
    for plan in shown:
        words = shlex.split(plan.command(cluster))
        assert words[0] == "torchrun" and words[words.index("-m") + 1 : words.index("-m") + 3] == [
            "slapo", "train",
        ]  # fmt: skip
        assert int(words[words.index("--nproc-per-node") + 1]) == plan.gpus
        two_nodes = shlex.split(plan.command(dataclasses.replace(cluster, gpus_per_node=1)))
        assert two_nodes[1:5] == ["--nnodes", "2", "--nproc-per-node", "1"]
        parser = argparse.ArgumentParser(prog="slapo")
        add_train(parser.add_subparsers(dest="command"))
        cfg = config_from_args(parser.parse_args(words[words.index("-m") + 2 :]))
        for name in ("tp", "pp", "cp", "ep", "batch_size", "seq_len", "target", "ckpt_ratio",
                     "ckpt_policy", "precision"):  # fmt: skip
            assert getattr(cfg, name) == getattr(plan.cfg, name), name
        if plan.cfg.pp > 1:
            assert cfg.num_microbatches == plan.cfg.num_microbatches


def test_bad_input_is_named(small_llama: str, tmp_path: Path) -> None:
    cluster = _cluster()
    with pytest.raises(PlanError, match="no config.json"):
        plan_layouts(str(tmp_path), cluster, gpus=8, seq_len=64, global_batch=8)
    with pytest.raises(PlanError, match="ac"):
        plan_layouts(small_llama, cluster, gpus=8, seq_len=64, global_batch=8, ac=("most",))
    with pytest.raises(PlanError, match="positive"):
        plan_layouts(small_llama, cluster, gpus=0, seq_len=64, global_batch=8)
    a100 = ClusterSpec(PRESETS["a100-80gb-sxm"])
    cfg = TrainConfig(model=small_llama, seq_len=64, batch_size=2, progress=False)
    with pytest.raises(Exception, match="fp8"):
        predict_config(cfg, a100, dp=1, float8=True)
    assert isinstance(PRESETS["h100-sxm"], DeviceSpec) and set(AC_CHOICES) >= {"none", "full"}


def test_roundpipe_where_nothing_else_fits(small_llama: str) -> None:
    # a device too small for any shard of the model state: RoundPipe keeps it on the host and
    # streams a layer at a time, one process driving the node's GPUs
    cluster = ClusterSpec(
        dataclasses.replace(PRESETS["h100-sxm"], hbm_gib=0.004), gpus_per_node=2
    )  # fmt: skip
    plans = plan_layouts(
        small_llama, cluster, gpus=2, seq_len=64, global_batch=4, ac=("none", "full")
    )  # fmt: skip
    assert [p.cfg.target for p in plans] == ["roundpipe"]
    (plan,) = plans
    assert plan.fits and plan.gpus == 2 and plan.ac == "none"
    assert plan.command(cluster).startswith("slapo train ") and "--target roundpipe" in (
        plan.command(cluster)
    )  # fmt: skip
    terms = plan.prediction.time_terms
    assert {"roundpipe host link (exposed)", "roundpipe host optimizer step"} <= set(terms)
    assert not any("(optimizer)" in k for k in terms)  # the host steps, not the device
    small_host = dataclasses.replace(cluster, host_gib=1e-4)
    assert plan_layouts(small_llama, small_host, gpus=2, seq_len=64, global_batch=4) == []
