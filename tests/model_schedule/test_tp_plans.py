"""Plans as data (issue 24): Hugging Face's own plans translated, plans inferred from the
projections' names, experts, sequence parallelism; each equal to one process on 2 gloo ranks, or
a typed error naming what cannot be placed."""

from __future__ import annotations

import pytest
import torch
from tp_plan_jobs import CASES, plans_job

from dist_utils import check_all, run_workers
from slapo.exceptions import SlapoError
from slapo.model_schedule import STYLES, TPPlan, from_hf_plan
from slapo.testing import zoo_models

#: Cases whose Hugging Face plan is incomplete in older transformers releases (refused there).
OLDER_PLANS_REFUSED = ("llama4_text",)


@pytest.fixture(scope="module")
def report():
    reports = check_all(run_workers(plans_job, 2, deadline=240.0))
    assert reports[0]["errors"] == reports[1]["errors"]
    return reports


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_plan_keeps_loss_and_every_gradient(report, case):
    if report[0][case] is None:
        pytest.skip(f"{CASES[case][0]} is newer than the installed transformers")
    for rank, result in enumerate(report):
        if isinstance(result[case], str):  # refused, typed
            # transformers before 5.24 gives Llama 4's experts no "moe_tp_experts" entry: nothing
            # would reduce the split expert weights, and the plan is refused by name
            assert case in OLDER_PLANS_REFUSED and "neither marked" in result[case], result[case]
            continue
        ref_loss, loss, worst, where, sharded = result[case]
        assert sharded > 0, f"{case}: nothing sharded"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert worst < 1e-4, f"rank {rank}: {case}: gradient of {where} off by {worst:.2e}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_plans_that_cannot_be_right_raise_typed_errors(report):
    errors = report[0]["errors"]
    assert "config.num_attention_heads = 3 does not divide by 2" in errors["heads"]
    assert "no rowwise projection to reduce it" in errors["no row"]
    assert "sequence_parallel: the plan uses experts" in errors["sequence parallel experts"]
    # Hugging Face's own plan splits Inkling 2's packed gate/up weight across its halves
    if errors["packed halves"] is not None:  # (a model type of transformers 5.24)
        assert '"gate_up_proj" 64, "down_proj" 32 features' in errors["packed halves"]


def test_hf_plans_translate_to_our_styles():
    plan = from_hf_plan(zoo_models.tiny_model("qwen3"))
    assert plan.styles["model.layers.*.self_attn.q_norm"] == "replicated_grad"
    assert plan.styles["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert set(plan.styles.values()) <= set(STYLES)
    assert from_hf_plan(zoo_models.tiny_model("gpt2")) is None  # none of its own: inferred


def test_a_style_slapo_lacks_is_refused_by_name():
    model = zoo_models.tiny_model("llama")
    model.config.base_model_tp_plan = {"layers.*.mlp.up_proj": "moe_identity_expert"}
    with pytest.raises(SlapoError, match="'moe_identity_expert', which slapo does not implement"):
        from_hf_plan(model)
    with pytest.raises(SlapoError, match="\"a.b\" has the style 'diagonal'"):
        TPPlan({"a.b": "diagonal"})
