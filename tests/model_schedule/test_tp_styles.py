"""Tensor-parallel styles as values (issue 38): a plan prints as the code that makes it, loads
back from JSON equal, and the loaded plan shards GPT-2 and T5 as the original does, with the
loss and every gradient of one process (2 gloo ranks); an unknown style is a typed error."""

from __future__ import annotations

import doctest
import json
from typing import Any

import pytest
import torch

import hf_models
import slapo
from dist_utils import check_all, run_workers
from slapo.exceptions import SlapoError
from slapo.model_schedule import STYLES, TPPlan, apply_tp_plan, tp_plan, tp_styles
from slapo.model_schedule.gpt2 import GPT2_PLAN
from slapo.model_schedule.llama import LLAMA_PLAN
from slapo.model_schedule.opt import OPT_PLAN
from slapo.model_schedule.t5 import T5_PLAN
from slapo.model_schedule.tp_styles import (
    REGISTRY,
    Colwise,
    PackedColwise,
    Rowwise,
    Style,
    TPStyleError,
    VocabEmbedding,
    parse_style,
)
from slapo.sharding import get_shard_spec

PLANS = {"gpt2": GPT2_PLAN, "t5": T5_PLAN, "llama": LLAMA_PLAN, "opt": OPT_PLAN}
#: Where each family's blocks are (the plans' own schedules pass them).
BLOCKS = {"gpt2": ("transformer.h",), "t5": ("encoder.block", "decoder.block")}
REGISTRY_CLASSES = {cls.__name__: cls for cls in REGISTRY.values()}


def test_a_plan_prints_as_the_code_that_makes_it():
    assert repr(GPT2_PLAN) == (
        "TPPlan({\n"
        "    'transformer.h.*.attn.c_attn': PackedColwise(parts=3),\n"
        "    'transformer.h.*.attn.c_proj': Rowwise(),\n"
        "    'transformer.h.*.mlp.c_fc': Colwise(),\n"
        "    'transformer.h.*.mlp.c_proj': Rowwise(),\n"
        "    'transformer.wte': VocabEmbedding(),\n"
        "}, divide={'transformer.h.*.attn': ('split_size', 'embed_dim', 'num_heads')})"
    )
    names = {"TPPlan": TPPlan, **REGISTRY_CLASSES}
    for plan in PLANS.values():
        assert eval(repr(plan), names) == plan  # noqa: S307  (our own repr)
    assert repr(TPPlan({"a": "local"}, head_parallel=False)).endswith("head_parallel=False)")


@pytest.mark.parametrize("family", list(PLANS))
def test_a_plan_round_trips_through_json(family):
    plan = PLANS[family]
    text = plan.to_json()
    assert json.loads(text)["styles"]  # plain JSON: names, or {"style": ..., **fields}
    loaded = TPPlan.from_json(text)
    assert loaded == plan
    assert loaded.styles == plan.styles and loaded.divide == plan.divide
    assert all(type(a) is type(b) for a, b in zip(loaded.styles.values(), plan.styles.values()))
    assert TPPlan.from_dict(plan.to_dict()) == plan


def test_styles_are_values_equal_to_the_names_plans_are_written_with():
    assert GPT2_PLAN.styles["transformer.h.*.attn.c_attn"] == PackedColwise(parts=3)
    assert GPT2_PLAN.styles["transformer.h.*.attn.c_attn"] != PackedColwise()
    assert PackedColwise() == "packed_colwise" and str(PackedColwise(parts=3)) != "packed_colwise"
    assert Colwise() == "colwise" and Colwise() != Rowwise() and Colwise() != PackedColwise()
    assert set(T5_PLAN.styles.values()) <= set(STYLES)
    assert TPPlan({"a": "colwise"}) == TPPlan({"a": Colwise()})
    assert TPPlan.from_dict({"wte": "vocab_embedding"}).styles["wte"] == VocabEmbedding()
    assert isinstance(parse_style({"style": "packed_colwise", "parts": 3}, "x"), PackedColwise)


def test_an_unknown_style_names_the_path_and_the_styles():
    with pytest.raises(TPStyleError) as err:
        TPPlan({"model.layers.*.mlp.up_proj": "diagonal"})
    assert isinstance(err.value, SlapoError)
    message = str(err.value)
    assert "\"model.layers.*.mlp.up_proj\" has the style 'diagonal'" in message
    assert all(name in message for name in STYLES)
    with pytest.raises(TPStyleError, match='"h.0.attn.c_attn".*packed_colwise takes'):
        TPPlan.from_dict({"h.0.attn.c_attn": {"style": "packed_colwise", "thirds": 3}})
    with pytest.raises(TPStyleError, match='"h.0.mlp" has the style 7'):
        TPPlan({"h.0.mlp": 7})


def test_a_new_style_registers_itself_by_its_name():
    class Marker(Style):
        name = "test_marker"

    try:
        plan = TPPlan({"a.b": "test_marker"})
        assert isinstance(plan.styles["a.b"], Marker) and "test_marker" in str(
            pytest.raises(TPStyleError, TPPlan, {"a.b": "nope"}).value
        )
    finally:
        del REGISTRY["test_marker"]


def test_docstring_examples_run():
    for module in (tp_plan, tp_styles):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# ----- the loaded plan shards as the original, on 2 gloo ranks ------------------------------------
#: case -> (family, config overrides); gated T5 (v1.1) splits wi_0 and wi_1 as it does wi
CASES = {
    "gpt2": ("gpt2", {}),
    "t5": ("t5", {}),
    "t5 gated": ("t5", {"feed_forward_proj": "gated-gelu"}),
}


def _step(case: str, plan: TPPlan) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    family, config = CASES[case]
    model = hf_models.make(family, dropout=0.0, **config)
    sch = slapo.create_schedule(model, group=torch.distributed.group.WORLD)
    blocks = [f"{p}.{n}" for p in BLOCKS[family] for n in sch[p].child]
    apply_tp_plan(sch, plan, blocks)
    model, _ = slapo.build(sch, init_weights=False)
    loss, grads = hf_models.run(model, hf_models.batch())
    return model, loss, grads


def loaded_plan_job(rank: int, world: int) -> dict[str, Any]:
    """Per family: the loss and gradients of the original and the JSON-loaded plan, and the
    reference's, every sharded gradient taken as this rank's slice of the reference's."""
    out = {}
    for case, (family, config) in CASES.items():
        ref = hf_models.make(family, dropout=0.0, **config)
        ref_loss, ref_grads = hf_models.run(ref, hf_models.batch())
        model, loss, grads = _step(case, PLANS[family])
        _, loaded_loss, loaded_grads = _step(case, TPPlan.from_json(PLANS[family].to_json()))
        specs = {n: get_shard_spec(p) for n, p in model.named_parameters()}
        want = {n: g if specs[n] is None else specs[n].local_slice(g) for n, g in ref_grads.items()}
        layout = {n: None if s is None else (s.axis, s.fused) for n, s in specs.items()}
        out[case] = (ref_loss, loss, loaded_loss, want, grads, loaded_grads, layout)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_loaded_plan_gives_the_same_model_and_gradients():
    reports = check_all(run_workers(loaded_plan_job, 2, deadline=150.0))
    for report in reports:
        for family, (ref_loss, loss, loaded, want, grads, loaded_grads, layout) in report.items():
            torch.testing.assert_close(loaded, loss, rtol=0, atol=0)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
            assert loaded_grads.keys() == grads.keys() == want.keys(), family
            for name, grad in grads.items():
                torch.testing.assert_close(loaded_grads[name], grad, rtol=0, atol=0)
                torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5)
            assert sum(s is not None for s in layout.values()) > 0, f"{family}: nothing sharded"
    gpt2 = reports[0]["gpt2"][-1]
    assert gpt2["transformer.h.0.attn.c_attn.weight"] == (1, 3)  # Conv1D [in, 3 x out]: thirds
    assert gpt2["transformer.wte.weight"] == (0, 1)  # over the vocabulary
    t5 = reports[0]["t5"][-1]
    assert t5["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == (1, 1)
    assert t5["decoder.block.0.layer.1.EncDecAttention.k.weight"] == (0, 1)
    gated = reports[0]["t5 gated"][-1]
    assert gated["encoder.block.0.layer.1.DenseReluDense.wi_1.weight"] == (0, 1)
    assert gated["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == (1, 1)
