"""Every family's ready schedule and each knob keep loss and gradients equal to the unscheduled
model; checkpointing everything at least halves the bytes saved for backward."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_models as H
from slapo.exceptions import SlapoError
from slapo.model_schedule import (
    Knobs,
    apply_schedule,
    helpers,
    list_families,
    recommended_knobs,
    register_schedule,
)
from slapo.tune import Space
from slapo.tune.schedule_space import tuning_space

FAMILIES = ["gpt2", "llama", "bert", "opt", "t5"]
FUSIBLE = {"gpt2", "bert"}
# knobs -> exact. Bit-identical on any CPU and thread count where every kernel runs on the same
# operands in the same autograd graph: no knob, a pipeline cut (a mark for the pipeline target),
# a non-reentrant checkpoint (the graph is kept, so each gradient is summed in the same order; the
# recompute reruns the same kernels under the restored RNG state). New kernels (attention, fused
# loss, fused ops) sum in another order: float32 tolerance, without dropout.
KNOBS = [
    ({"ckpt_ratio": 0.0}, True),  # the plan alone (no knobs at all is the recommended schedule)
    ({"ckpt_ratio": 0.5}, True),
    ({"ckpt_ratio": 1.0}, True),
    ({"num_stages": 2, "ckpt_ratio": 0.0}, True),
    ({"attn_op": "eager"}, False),
    ({"attn_op": "sdpa"}, False),
    ({"fused_loss": True}, False),
    ({"fuse_ops": True}, False),
    ({"ckpt_ratio": 1.0, "attn_op": "sdpa", "fused_loss": True}, False),
]


@pytest.mark.parametrize("knobs,exact", KNOBS, ids=[str(k) for k, _ in KNOBS])
@pytest.mark.parametrize("family", FAMILIES)
def test_schedule_keeps_loss_and_gradients(family, knobs, exact):
    if knobs.get("fuse_ops") and family not in FUSIBLE:
        pytest.skip(f"{family} has nothing to fuse (tested as an error below)")
    # new kernels draw dropout masks differently: compare them without dropout
    ref = H.make(family, dropout=0.1 if exact else 0.0)
    test = H.twin(ref)
    sch = apply_schedule(test, **knobs)
    assert sch.extra["model_schedule"]["family"] == family
    H.assert_same_step(ref, test, exact=exact)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_knobs_means_the_recommended_schedule(family):
    sch = apply_schedule(H.make(family))
    info = sch.extra["model_schedule"]
    assert info["recommended"] and info["plan"] == "ready"
    for name, value in recommended_knobs(family).items():
        assert info[name] == value, name


def test_any_knob_means_exact_control():
    info = apply_schedule(H.make("llama"), ckpt_ratio=0.5).extra["model_schedule"]
    assert not info["recommended"]
    assert (info["compile_model"], info["ckpt_policy"], info["attn_op"]) == (False, None, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_leaves_the_cache_setting_to_generate(family):
    # transformers' defaults (use_cache=True) with eager attention, where a cache written twice
    # (first run and recompute) breaks backward: the checkpointed blocks run without it instead.
    ref = H.make(family, use_cache=True, attn_implementation="eager")
    test = H.twin(ref)
    apply_schedule(test, ckpt_ratio=0.5)

    def cache_settings(model: torch.nn.Module) -> list[bool]:
        return [m.config.use_cache for m in model.modules() if hasattr(m, "config")]

    assert test.config.use_cache and cache_settings(test) == cache_settings(ref)  # untouched
    # The reference's attention reads k/v copied into the cache (contiguous), the checkpointed
    # blocks' strided views: other kernel paths, ulps apart on some CPUs.
    H.assert_same_step(ref, test)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_every_block_halves_the_saved_bytes(family):
    def saved_bytes(model: torch.nn.Module) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**H.batch()).loss
        loss.backward()
        return sum(seen.values())

    ref = H.make(family)
    test = H.twin(ref)
    apply_schedule(test, ckpt_ratio=1.0)
    full, ckpt = saved_bytes(ref), saved_bytes(test)
    assert ckpt * 2 <= full, (family, ckpt, full)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3"])
def test_llama_layout_families(model_type):
    cfg_cls = {"mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[model_type]
    model_cls = {"mistral": transformers.MistralForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}
    cfg = cfg_cls(
        vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = model_cls[model_type](cfg).train()
    test = H.twin(ref)
    sch = apply_schedule(test, ckpt_ratio=1.0, attn_op="sdpa")
    assert sch.extra["model_schedule"]["family"] == model_type
    # slapo's attention kernel, and the reference builds a cache (transformers' default): ulps.
    H.assert_same_step(ref, test, exact=False)


def test_fused_loss_never_returns_logits_with_labels():
    model = H.make("llama")
    apply_schedule(model, fused_loss=True)
    out = model(**H.batch())
    assert out.loss is not None and out.logits is None and next(iter(out.values())) is out.loss
    plain = model(input_ids=H.batch()["input_ids"])  # no labels: ordinary logits
    assert plain.logits.shape == (H.BATCH, H.SEQ, H.VOCAB)
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight
        or not model.config.tie_word_embeddings
    )


def test_pipeline_cuts_split_blocks_evenly():
    sch = apply_schedule(H.make("llama", layers=4), num_stages=2)
    assert [r.path for r in sch.metadata.primitives if r.name == "cut_pipeline_stage"] == [
        "model.layers.1"
    ]
    with pytest.raises(SlapoError, match="num_stages=3 exceeds the 2 blocks"):
        apply_schedule(H.make("gpt2"), num_stages=3)


def test_fused_kernels_compile_with_inductor(monkeypatch):
    from slapo.model_schedule import fusion

    monkeypatch.setattr(fusion, "COMPILER", "inductor")
    ref = H.make("gpt2", dropout=0.0)
    test = H.twin(ref)
    apply_schedule(test, fuse_ops=True)
    assert type(test.transformer.h[0].mlp.c_fc).__name__ == "LinearBiasGELU"
    assert set(dict(test.named_parameters())) == set(dict(ref.named_parameters()))
    H.assert_same_step(ref, test, exact=False)  # generated kernels: another summation order


def test_bad_input_gets_clear_errors():
    model = H.make("llama")
    with pytest.raises(
        SlapoError, match="no ready schedule for model type 'falcon'.*register_schedule"
    ):
        apply_schedule(model, "falcon")
    with pytest.raises(SlapoError, match="known families: bert, gpt2, llama"):
        apply_schedule(model, "falcon")
    with pytest.raises(SlapoError, match=r"unknown knobs \['ckpt'\]"):
        apply_schedule(model, ckpt=0.5)
    with pytest.raises(SlapoError, match="ckpt_ratio must be a number in"):
        apply_schedule(model, ckpt_ratio=1.5)
    with pytest.raises(SlapoError, match="attn_op must be one of"):
        apply_schedule(model, attn_op="fast")
    with pytest.raises(SlapoError, match="num_stages must be a positive int"):
        apply_schedule(model, num_stages=0)
    with pytest.raises(SlapoError, match="sequence_parallel=True needs tensor parallelism"):
        apply_schedule(model, sequence_parallel=True)
    with pytest.raises(SlapoError, match="llama: fuse_ops is not supported: .*nothing to fuse"):
        apply_schedule(model, fuse_ops=True)
    with pytest.raises(SlapoError, match="fused_loss must be True or False"):
        apply_schedule(model, fused_loss="yes")
    if not torch.cuda.is_available():
        with pytest.raises(SlapoError, match="attn_op='flash' needs CUDA"):
            apply_schedule(model, attn_op="flash")
    with pytest.raises(SlapoError, match="the generic plan found no blocks in Linear"):
        apply_schedule(torch.nn.Linear(2, 2))


def test_register_a_family_and_pass_it_by_name():
    @register_schedule("tiny_llama_test")
    def tiny(sch, knobs):
        helpers.checkpoint_blocks(sch, helpers.blocks(sch, "model.layers"), knobs.ckpt_ratio)

    assert "tiny_llama_test" in list_families()
    sch = apply_schedule(H.make("llama"), "tiny_llama_test", ckpt_ratio=1.0)
    assert [r.name for r in sch.metadata.primitives] == ["checkpoint", "checkpoint"]


def test_every_knob_is_a_tuning_symbol():
    shared = {"ckpt_ratio", "ckpt_policy", "compile_blocks", "compile_model", "compile_rng"}
    shared |= {"attn_op"}
    gpt2 = tuning_space(Space(), "gpt2", world_size=2, tp_size=2).to_dict()
    assert set(gpt2) == shared | {"fuse_ops", "sequence_parallel", "num_stages"}
    llama = tuning_space(Space(), "llama")
    assert set(llama.to_dict()) == shared | {"fused_loss"}
    assert set(llama.to_dict()) <= set(Knobs.__dataclass_fields__)
    configs = list(Space(lambda args, space: tuning_space(space, "llama")))
    compiling = 4 * 2  # compile_blocks x compile_model x compile_rng
    assert (
        len(configs)
        == 3 * len(llama["ckpt_policy"].vals) * compiling * len(llama["attn_op"].vals) * 2
    )
    for cfg in configs:  # every point of the space is a valid schedule
        apply_schedule(H.make("llama"), **cfg)
