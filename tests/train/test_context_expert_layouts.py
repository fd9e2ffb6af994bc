"""`slapo train --cp C --ep E` beside dp x pp x tp: the one-process loss curve.

Context parallelism splits every sequence over the cp ranks (the batch rows stay the dp
replica's); expert parallelism splits the experts of every MoE layer over ranks borrowed from
dp x cp. Neither changes the global batch (``--batch-size`` x dp), so each layout must follow
the one process's curve with that batch.
"""

from __future__ import annotations

import pytest
from layout_runs import ONE_PROCESS, plan_run, same_curve

from slapo.exceptions import SlapoError
from slapo.train import TrainConfig, train
from slapo.train.job_layout import check_context_expert

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

MOE = ["--model", "qwen3_moe"]


def one_process(batch: int, steps: int = 20, **cfg: object) -> list[float]:
    return train(TrainConfig(batch_size=batch, **{**ONE_PROCESS, "steps": steps, **cfg}))["losses"]


# The torchrun runs of this file, each planned into the session's launch of its world size
# (the ``launches`` fixture, tests/conftest.py); each test checks its own. Runs sharing a
# checkpoint run in the order planned: the save before the resume.
CP2 = ["--cp", "2", "--batch-size", "8", "--steps", "30"]
EP2 = [*MOE, "--ep", "2", "--batch-size", "2"]
BF16 = {"cp2": ["--cp", "2", "--batch-size", "4"], "ep2": [*MOE, "--ep", "2", "--batch-size", "2"]}
plan_run(2, "cp2", lambda root: [*CP2, "--save", str(root / "cp2-saved"), "--save-every", "15"])
plan_run(2, "cp2-resumed", lambda root: [*CP2, "--resume", str(root / "cp2-saved/step-000015")])
plan_run(2, "ep2", lambda root: [*EP2, "--save", str(root / "ep2-saved"), "--save-every", "10"])
plan_run(2, "ep2-resumed", lambda root: [*EP2, "--resume", str(root / "ep2-saved/step-000010")])
for _name, _flags in BF16.items():
    plan_run(2, f"bf16-{_name}", lambda root, f=_flags: [*f, "--steps", "6", "--precision", "bf16"])
plan_run(8, "dp2-cp2-tp2", lambda root: ["--cp", "2", "--tp", "2", "--batch-size", "4",
                                         "--steps", "12"])  # fmt: skip
plan_run(4, "dp2-ep2-pp2", lambda root: [*MOE, "--ep", "2", "--pp", "2", "--batch-size", "4",
                                         "--steps", "12"])  # fmt: skip


def test_cp2_follows_the_one_process_curve_for_30_steps_and_resumes_exactly(launches):
    """``--cp 2`` on 2 processes: each holds half of every sequence (two chunks, load-balanced)
    and attention gathers keys and values; the one-process curve of the same batch, 30 steps.
    Its step-15 checkpoint (the one layout-free directory) resumes the run bit for bit (a run of
    its own, later in the same launch)."""
    got, metrics = launches.result(2, "cp2")
    same_curve(got, one_process(8, steps=30), steps=30)
    assert metrics["layout"] == "dp 1 x pp 1 x cp 2 x tp 1 (2 processes)"
    assert "attn_op=None" in metrics["stdout"]  # the model's own attention, run over cp
    again, metrics = launches.result(2, "cp2-resumed")
    assert metrics["resumed_at"] == 15 and again == got  # exact: same ranks, same sums


def test_dp2_cp2_tp2_follows_the_one_process_curve(launches):
    """dp 2 x cp 2 x tp 2 on 8 processes (Llama's ready schedule, tensor parallel inside each
    cp rank): the one-process curve of the global batch (4 x dp 2)."""
    got, metrics = launches.result(8, "dp2-cp2-tp2")
    same_curve(got, one_process(8, steps=12), steps=12)
    assert metrics["layout"] == "dp 2 x pp 1 x cp 2 x tp 2 (8 processes)"


def test_ep2_on_an_moe_model_follows_the_one_process_curve_and_saves_whole(launches, tmp_path):
    """``--ep 2`` on a Qwen3-MoE (the generic plan): each rank keeps half the experts of every
    MoE layer and sends tokens to the other's with all-to-all; the curve of one process on the
    global batch (2 x dp 2), each rank holding fewer parameters than the whole model. The
    checkpoint is the one layout-free directory: every expert tensor whole, the one process's
    weights (float32 rounding apart), and its step-10 checkpoint resumes the run exactly (a run
    of its own, later in the same launch)."""
    import torch
    from transformers import AutoModelForCausalLM

    got, metrics = launches.result(2, "ep2")
    saved, whole_dir = launches.dir(2) / "ep2-saved", tmp_path / "whole"
    whole = train(TrainConfig(model="qwen3_moe", batch_size=4, save=str(whole_dir), **ONE_PROCESS))
    same_curve(got, whole["losses"])
    assert metrics["layout"] == "dp 2 x pp 1 x tp 1, ep 2 (2 processes)"
    assert all(r["parameters"] < whole["parameters"] for r in metrics["ranks"])
    mine = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    want = AutoModelForCausalLM.from_pretrained(whole_dir).state_dict()
    assert mine.keys() == want.keys() and any("experts" in k for k in mine)
    for name, tensor in want.items():
        # AdamW turns rounding in tiny gradients into updates of lr size: measured under 6e-5
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=3e-4, msg=name)
    again, metrics = launches.result(2, "ep2-resumed")
    assert metrics["resumed_at"] == 10 and again == got


@pytest.mark.parametrize(
    "cfg, target, message",
    [
        ({"cp": 2, "pp": 2}, "pipeline", r"--cp 2 with --pp 2: context parallelism inside"),
        ({"cp": 2, "target": "roundpipe"}, "roundpipe", r"--cp 2 with --target roundpipe"),
        ({"cp": 4, "seq_len": 36}, "ddp", r"--seq-len 36 must be a multiple of 8"),
        ({"cp": 2, "attn_op": "flash"}, "ddp", r"--cp 2 with --attn-op flash"),
        ({"cp": 2, "fused_loss": True}, "ddp", r"--cp 2 with --fused-loss"),
        ({"ep": 2, "tp": 2}, "ddp", r"--ep 2 with --tp 2: tensor parallelism would shard"),
        ({"ep": 2, "target": "fsdp"}, "fsdp", r"--ep 2 with --target fsdp"),
    ],
)
def test_layouts_cp_and_ep_cannot_run_are_named(cfg, target, message):
    with pytest.raises(SlapoError, match=message):
        check_context_expert(TrainConfig(**cfg), target)


def test_ep_that_does_not_divide_dp_x_cp_is_named():
    """One process: dp x cp = 1, which --ep 2 cannot borrow from (the check runs after the
    process group started, which one process skips)."""
    base = {"steps": 1, "batch_size": 2, "seq_len": 16, "progress": False, "model": "qwen3_moe"}
    with pytest.raises(SlapoError, match=r"--ep 2 borrows its ranks from dp x cp = 1 x 1"):
        train(TrainConfig(ep=2, **base))


def test_dp2_ep2_pp2_follows_the_one_process_curve(launches):
    """dp 2 x pp 2 on 4 processes with ep 2 borrowed from dp: each stage's MoE layers keep half
    their experts, tokens cross to the other replica's experts inside the pipeline (the traced
    stages call the dispatch as one op); the one-process curve of the global batch (4 x dp 2)."""
    got, metrics = launches.result(4, "dp2-ep2-pp2")
    same_curve(got, one_process(8, steps=12, model="qwen3_moe"), steps=12)
    assert metrics["layout"] == "dp 2 x pp 2 x tp 1, ep 2 (4 processes)"


@pytest.mark.parametrize(
    "layout, batch, model", [("cp2", 4, "llama"), ("ep2", 4, "qwen3_moe")], ids=["cp2", "ep2"]
)
def test_bf16_follows_the_one_process_bf16_curve(launches, layout, batch, model):
    """``--precision bf16`` with cp 2 (bf16 keys and values gathered; :data:`BF16` flags) and
    with ep 2 (bf16 token rows exchanged): 6 steps within 0.02 of one process in bf16 with the
    global batch (bf16 rounds sums the layout orders otherwise; measured: under 3e-3)."""
    got, metrics = launches.result(2, f"bf16-{layout}")
    want = one_process(batch, steps=6, model=model, precision="bf16")
    assert metrics["precision"] == "bf16" and len(got) == len(want) == 6
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.02, (got, want)
    assert got[-1] < 0.85 * got[0]  # it trains
