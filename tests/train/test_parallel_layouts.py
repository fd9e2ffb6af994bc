"""`slapo train` on data x pipeline x tensor parallel layouts: the one-process loss curve.

Under ``torchrun --nproc-per-node N ... --tp T --pp P`` the run has dp = N / (T * P) replicas,
each training on its slice of a global batch of ``--batch-size`` x dp; the loss curve must be the
one process's with that global batch. Two torchrun launchers on loopback stand for two nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from layout_runs import ONE_PROCESS, SEQ, plan_run, same_curve, torchrun

from dist_utils import free_port
from slapo.train import TrainConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def one_process() -> dict[int, list[float]]:
    """The one-process loss curves for global batches of 8 and 16."""
    return {b: train(TrainConfig(batch_size=b, **ONE_PROCESS))["losses"] for b in (8, 16)}


# The torchrun runs of this file, each planned into the session's launch of its world size
# (the ``launches`` fixture, tests/conftest.py); each test checks its own. Runs sharing a
# checkpoint run in the order planned: the save before the resume.
LAYOUTS = [
    (4, ["--tp", "2", "--pp", "2"], 8),  # pp 2 x tp 2
]
# dp2-pp2-tp2 and dp2-pp2: the tests below; dp2 x tp2: tests/targets/test_dp.py (engine) and
# benchmarks/parallel_layouts.py (this curve, 30 steps)
for _nproc, _flags, _ in LAYOUTS:
    plan_run(_nproc, " ".join(_flags), lambda root, f=_flags: ["--batch-size", "8", *f])
THREE_D = ["--batch-size", "8", "--tp", "2", "--pp", "2", "--target", "fsdp"]
plan_run(8, "3d", lambda root: [*THREE_D, "--save", str(root / "3d-whole"), "--save-every", "10",
                                "--keep", "1"])  # fmt: skip
plan_run(8, "3d-resumed", lambda root: [*THREE_D, "--resume", str(root / "3d-whole/step-000010"),
                                        "--save", str(root / "3d-resumed-saved")])  # fmt: skip
plan_run(8, "3d-bf16", lambda root: [*THREE_D, "--steps", "10", "--precision", "bf16",
                                     "--save", str(root / "3d-bf16-saved")])  # fmt: skip


@pytest.mark.parametrize("nproc, flags, batch", LAYOUTS)
def test_layout_follows_the_one_process_curve(launches, one_process, nproc, flags, batch):
    losses, metrics = launches.result(nproc, " ".join(flags))
    same_curve(losses, one_process[batch])
    ranks = metrics["ranks"]
    assert [r["rank"] for r in ranks] == list(range(nproc))
    assert all(r["parameters"] > 0 and r["peak_memory_mb"] > 0 for r in ranks)
    dp = batch // 8
    assert f"dp {dp} x" in metrics["layout"] and "layout:" in metrics["stdout"]


def _tensors(directory: Path) -> dict[str, object]:
    """Every tensor of every safetensors file of a checkpoint directory, read in this process."""
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update({f"{file.name}:{k}": v for k, v in load_file(file).items()})
    return out


def test_3d_run_follows_one_process_and_resumes_exactly(launches, one_process):
    """dp 2 x pp 2 x tp 2 on 8 processes, the replicas FSDP2-sharded: the one-process curve of
    the global batch; a run resumed from its step-10 checkpoint (a run of its own, later in the
    same launch) continues it bit for bit, and both final checkpoints (weights and AdamW state,
    written by 8 ranks) load in one process, every tensor equal."""
    import torch
    from transformers import AutoModelForCausalLM

    whole, resumed = launches.dir(8) / "3d-whole", launches.dir(8) / "3d-resumed-saved"
    losses, metrics = launches.result(8, "3d")
    same_curve(losses, one_process[16])
    assert metrics["layout"] == "dp 2 x pp 2 x tp 2 (8 processes)"
    assert [r["rank"] for r in metrics["ranks"]] == list(range(8))
    again, metrics = launches.result(8, "3d-resumed")
    assert metrics["resumed_at"] == 10 and again == losses  # exact: same ranks, same sums
    saved, redone = _tensors(whole), _tensors(resumed)
    assert saved.keys() == redone.keys() and any("optimizer" in k for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, redone[key]), key
    weights = {k.split(":", 1)[1]: v for k, v in saved.items() if k.startswith("model")}
    state = AutoModelForCausalLM.from_pretrained(whole).state_dict()
    assert weights and weights.keys() <= state.keys(), weights.keys() - state.keys()
    for name, tensor in weights.items():  # (a tied duplicate is stored once)
        assert torch.equal(state[name], tensor), name


def test_two_nodes_on_loopback_give_the_one_node_curve(tmp_path, one_process):
    """Two torchrun launchers, two processes each, meeting at a c10d rendezvous on 127.0.0.1:
    dp 2 x pp 2 spread over the two "nodes" (``--num-stages``: the older spelling of ``--pp``)."""
    out, port = tmp_path / "run", free_port()
    flags = ["--batch-size", "8", "--num-stages", "2"]
    nodes = [torchrun(2, flags, out, node=(2, rank, port)) for rank in (0, 1)]
    for proc in nodes:  # global rank 0 (which writes metrics.json) is on either node
        _, stderr = proc.communicate(timeout=540)
        assert proc.returncode == 0, stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    losses = metrics["losses"]
    assert metrics["world_size"] == 4
    same_curve(losses, one_process[16])


def test_layouts_that_do_not_fit_the_processes_are_named():
    from slapo.exceptions import SlapoError

    base = {"steps": 1, "batch_size": 2, "seq_len": 16, "progress": False}
    with pytest.raises(SlapoError, match=r"--tp 2 x --pp 2 needs a multiple of 4 processes"):
        train(TrainConfig(tp=2, pp=2, **base))
    with pytest.raises(SlapoError, match="--pp 2 with --target roundpipe is not wired"):
        train(TrainConfig(pp=2, target="roundpipe", **base))


def test_3d_bf16_follows_the_one_process_bf16_curve(launches):
    """``--precision bf16`` on dp 2 x pp 2 x tp 2 (FSDP2 replicas; the stages autocast, the
    tensor-parallel collectives carry bf16 activations): 10 steps within 0.05 of one process in
    bf16 with the global batch (bf16 rounds sums that the layout orders otherwise; measured:
    under 0.01), and the checkpoint keeps the float32 master weights."""
    import torch
    from safetensors.torch import load_file

    cfg = {"steps": 10, "seq_len": SEQ, "progress": False, "sample": False, "baseline_steps": 0,
           "compile_model": False, "batch_size": 16, "precision": "bf16"}  # fmt: skip
    want = train(TrainConfig(**cfg))["losses"]
    saved = launches.dir(8) / "3d-bf16-saved"
    got, metrics = launches.result(8, "3d-bf16")
    assert metrics["precision"] == "bf16" and "bf16 mixed precision" in metrics["stdout"]
    assert len(got) == len(want) == 10
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, (got, want)
    assert got[-1] < 0.85 * got[0]  # it trains
    for rank in metrics["ranks"]:  # the bf16 estimate of each rank (measured: within 1%)
        assert abs(rank["estimated_peak_mb"] / rank["peak_memory_mb"] - 1) < 0.10, rank
    files = sorted(saved.glob("model*.safetensors"))
    dtypes = {t.dtype for f in files for t in load_file(f).values()}
    assert files and dtypes == {torch.float32}, dtypes
