"""Published Slapo's ``apply_schedule`` knobs (its quick start's
``apply_schedule(model, "bert", model_config=config, prefix="bert", fp16=True, ckpt_ratio=0)``)
run unchanged: the context they give is checked against the model and recorded, the attention
names map onto ``attn_op``, and the scheduled model equals the unscheduled one."""

from __future__ import annotations

import pytest

import hf_models as H
import slapo
from slapo import SlapoError
from slapo.model_schedule import apply_schedule


def test_quick_start_call_schedules_bert_equal_to_the_unscheduled_model():
    model = H.make("bert", dropout=0.0)
    ref = H.twin(model)
    sch = apply_schedule(
        model, "bert", model_config=model.config, prefix="bert", fp16=True, ckpt_ratio=0
    )
    info = sch.extra["model_schedule"]
    assert (info["family"], info["prefix"], info["precision"]) == ("bert", "bert", "fp16")
    assert not info["recommended"] and info["ckpt_ratio"] == 0  # ckpt_ratio chosen: exact control
    built, _ = slapo.build(sch, init_weights=model._init_weights)
    H.assert_same_step(ref, built)


def test_context_knobs_alone_keep_the_recommended_schedule():
    """(The recommended schedule's equivalence is tested in test_selective_compile.)"""
    model = H.make("bert", dropout=0.0)
    sch = apply_schedule(model, model_config=model.config, bf16=True)
    info = sch.extra["model_schedule"]
    assert info["recommended"] and info["precision"] == "bf16"
    assert info["compile_model"]  # the recommended knobs, not the plain defaults


def test_published_attention_names_map_onto_attn_op():
    sch = apply_schedule(H.make("bert"), attn_op_name="cuda")  # FlashAttention; SDPA off CUDA
    assert sch.extra["model_schedule"]["attn_op"] in ("sdpa", "flash")
    sch = apply_schedule(H.make("bert"), disable_flash_attn=True)
    assert sch.extra["model_schedule"]["attn_op"] is None


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"prefix": "encoder"}, "prefix='encoder' names no submodule of BertForMaskedLM"),
        ({"fp16": True, "bf16": True}, "exclude each other"),
        ({"attn_op_name": "fastest"}, "attn_op_name='fastest' is not one of"),
        ({"model_config": "other"}, "model_config is not the config of the BertForMaskedLM"),
    ],
)
def test_published_knobs_that_contradict_the_model_are_refused(knobs, message):
    with pytest.raises(SlapoError, match=message):
        apply_schedule(H.make("bert"), **knobs)
