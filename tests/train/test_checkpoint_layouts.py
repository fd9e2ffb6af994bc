"""Checkpoints for every layout: pipeline stages (x tensor parallel, x data-parallel replicas)
save the directory one process saves and load it back; `slapo train --save/--resume` on the
pipeline and deepspeed targets continues a run exactly."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from checkpoint_layout_jobs import LR, make, single

from dist_utils import check_all, run_workers
from slapo.checkpoints import MARKER, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

# layout: (mesh shape, mesh dimensions, also load the one-process checkpoint into it)
LAYOUTS = {
    "pp2": ((2,), ("pp",), True),
    "pp2xtp2": ((2, 2), ("pp", "tp"), True),
    # two FSDP2 replicas of the pipeline (fed the same batches here): each holds a shard of its
    # stages; only data-parallel rank 0 writes, every replica loads its shard
    "dp2xpp2": ((2, 2), ("dp", "pp"), True),
}


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    """One process's checkpoint after a step (weights and Adam state unlike a fresh model's)."""
    path = tmp_path_factory.mktemp("single") / "ckpt"
    model, opt = single(seed=1, steps=1)
    save_checkpoint(model, path, opt)
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_checkpoint_is_the_one_process_checkpoint(layout, single_dir, tmp_path):
    from checkpoint_layout_jobs import save_and_compare

    shape, names, loads = LAYOUTS[layout]
    world = 1
    for n in shape:
        world *= n
    out = tmp_path / "ckpt"
    args = (shape, names, str(out), str(single_dir) if loads else None)
    results = check_all(run_workers(save_and_compare, world, args))
    stages = 2 * (2 if "dp" in names else 1)  # replicas hold the same stages
    assert sum(r["saved"] for r in results) >= 15 * stages // 2  # every rank checked its tensors
    assert all(r["loaded"] == r["saved"] for r in results)
    # the same keys, ties, files' contents and optimizer entries as one process writes
    mine, theirs = (json.loads((p / MARKER).read_text()) for p in (out, single_dir))
    assert mine["model_keys"] == theirs["model_keys"] and mine["aliases"] == theirs["aliases"]
    assert set(mine["model_files"]) == set(theirs["model_files"])
    assert mine["optimizer"]["tensors"] == theirs["optimizer"]["tensors"]
    assert [g["params"] for g in mine["optimizer"]["groups"]] == [
        g["params"] for g in theirs["optimizer"]["groups"]
    ]
    assert {p.suffix for p in out.iterdir()} == {".json", ".safetensors"}
    if "dp" in names:  # only data-parallel rank 0 (global ranks 0 and 1) wrote
        assert len(set(mine["model_files"].values())) <= 2
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    model = make(seed=5)
    load_checkpoint(model, out)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert LR == json.loads((out / MARKER).read_text())["optimizer"]["groups"][0]["lr"]


# ----- slapo train --save/--resume ---------------------------------------------------------------
RUN = {"steps": 3, "batch_size": 2, "seq_len": 32, "baseline_steps": 0, "compile_model": False,
       "progress": False, "sample": False, "tensorboard": False, "output_dir": None}  # fmt: skip
TARGETS = {
    # the default model has dropout: each stage's RNG stream is restored; the LR schedule too
    "pipeline": {"target": "pipeline", "pp": 2, "num_microbatches": 2,
                 "lr_schedule": "linear", "warmup_steps": 1},
    # ZeRO-2: the optimizer state is partitioned over the 2 ranks, gathered by parameter
    "deepspeed": {"target": "deepspeed"},
    # bf16: the module computes in bf16; the save holds ZeRO's float32 master weights, and the
    # resume scatters them back into the partitions (a bf16 round trip would lose bits)
    "deepspeed-bf16": {"target": "deepspeed", "precision": "bf16"},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_train_resume_continues_the_run_exactly(target, tmp_path):
    """On 2 gloo ranks, a run resumed from a --save-every step has the uninterrupted run's
    losses and learning rates, bit for bit; the save is a Hugging Face directory of the whole
    model and its Adam state, nothing pickled (not DeepSpeed's own checkpoint format)."""
    from checkpoint_layout_jobs import train_and_resume

    if target.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    save = tmp_path / "ckpt"
    options = {**RUN, **TARGETS[target]}
    runs = check_all(run_workers(train_and_resume, 2, (options, str(save)), deadline=240))
    for run in runs:
        full, rest = run["full"], run["rest"]
        assert rest["resumed_at"] == 2 and len(full["losses"]) == 3
        assert rest["losses"] == full["losses"] and rest["lrs"] == full["lrs"]
        if target == "deepspeed-bf16":  # the bf16 ZeRO-2 estimate (measured: 8% under)
            assert abs(full["estimated_peak_mb"] / full["peak_memory_mb"] - 1) < 0.10, full
    assert {p.suffix for p in save.rglob("*") if p.is_file()} == {".json", ".safetensors"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(save)  # the whole model
    assert loaded.get_output_embeddings().weight.shape[0] == loaded.config.vocab_size
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}  # the master weights
    marker = json.loads((save / MARKER).read_text())
    params = {n for n, _ in loaded.named_parameters()}
    assert set(marker["optimizer"]["tensors"]) == params  # Adam state of every parameter
    for per_param in marker["optimizer"]["tensors"].values():
        assert set(per_param) == {"exp_avg", "exp_avg_sq", "step"}
