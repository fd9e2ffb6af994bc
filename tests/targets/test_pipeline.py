"""The pipeline target on 2 and 4 gloo processes: single-process loss and gradients are the oracle.

The checks run in the suite's shared jobs (``conftest.py``); each test reports one check.
"""

from __future__ import annotations

import jobs_pp
import pytest
import torch

import hf_models
import slapo
from dist_utils import assert_check
from slapo.exceptions import PrimitiveError, TargetError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "check",
    [
        "gpt2_gpipe",
        "gpt2_1f1b",
        "llama_gpipe",
        "llama_1f1b",
        "gpt2_interleaved",
        "params_and_table",
        "ties_stay_equal",
        "stage_checkpoints",
        "first_stage_holds_nothing",
        "bad_input",
        "stage_failure",
    ],
)
def test_pp2(ranks2, check):
    assert_check(ranks2, check)


@pytest.mark.parametrize(
    "check",
    [
        "gpt2_gpipe",
        "gpt2_1f1b",
        "gpt2_cut_at_drop",
        "llama_gpipe",
        "llama_1f1b",
        "pp_x_tp_gpt2",
        "pp_x_tp_llama",
        "dp_x_pp_gpt2",
        "dp_x_pp_llama",
        "dp_x_pp_gpt2_fsdp",
        "grad_scaler_ddp",
        "grad_scaler_fsdp",
        "stage_failure",
    ],
)
def test_pp4(ranks4, check):
    """4 stages, or 2 stages x 2 tensor ranks (``pp_x_tp_*``: each rank's gradient slices).

    ``stage_failure``: ranks two hops from the failing stage fail promptly with its error too.
    """
    assert_check(ranks4, check)


@pytest.mark.parametrize("check", ["dp_pp_tp_gpt2", "dp_pp_tp_llama", "dp_pp_tp_gpt2_fsdp"])
def test_dp_pp_tp(ranks8, check):
    """3D: 2 data-parallel replicas x 2 stages x 2 tensor ranks on one ("dp", "pp", "tp") mesh:
    the whole batch's loss, each rank's gradient slices, clipping by the global norm; the
    replicas as DDP and as FSDP2 (gpt2: its tied embedding and head on two stages)."""
    assert_check(ranks8, check)


def test_cut_records_and_alias():
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    sch["transformer.h.0"].cut_pipeline_stage()
    sch["transformer.h.1.mlp"].pipeline_split()
    from slapo.primitives.cut_pipeline_stage import pipeline_cuts

    assert pipeline_cuts(sch) == ["transformer.h.0", "transformer.h.1.mlp"]


@pytest.mark.parametrize(
    ("path", "text"),
    [("", "root"), ("transformer.h", "transformer.h.0")],
)
def test_cut_where_no_boundary(path, text):
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    with pytest.raises(PrimitiveError, match=text):
        sch[path].cut_pipeline_stage()


def test_cut_twice():
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    sch["transformer.h.0"].cut_pipeline_stage()
    with pytest.raises(PrimitiveError, match="transformer.h.0"):
        sch["transformer.h.0"].cut_pipeline_stage()


def test_pipeline_needs_process_group():
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    sch["transformer.h.0"].cut_pipeline_stage()
    with pytest.raises(TargetError, match="slapo.env.setup"):
        slapo.build(sch, target="pipeline", num_microbatches=2)


@pytest.mark.parametrize(
    ("family", "cuts"),
    [("llama", jobs_pp.CUTS[("llama", 4)]), ("gpt2", jobs_pp.GPT2_AT_DROP)],
)
def test_stages_chain_like_the_model(family, cuts):
    """Values that skip stages are carried: each stage's flat tensor outputs feed the next."""
    from slapo.pipeline import partition_model

    model = jobs_pp.make(family)
    ids = jobs_pp.data()[0][:2]
    part = partition_model(model, cuts, (ids,), {"use_cache": False})
    values: tuple = (ids,)
    for stage in part.stages[:-1]:
        values = stage(*values)
        assert isinstance(values, tuple) and all(isinstance(v, torch.Tensor) for v in values)
    logits = part.stages[-1](*values)
    # Exact: the stages run the model's own calls on the same operands, only cut into pieces.
    torch.testing.assert_close(logits, model(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)
