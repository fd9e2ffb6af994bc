"""`slapo train --save/--save-every/--resume` on --target fsdp and --target roundpipe write the one
Hugging Face directory every other target writes: FSDP2's DTensor parameters and Adam state
gathered whole (re-sharded on resume), RoundPipe's optimizer copies saved by the names of the
parameters they stand for. A resumed run continues the uninterrupted curve bit for bit and
`from_pretrained` loads exactly the weights the run trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from gathered_checkpoint_job import train_keeping_weights

from dist_utils import free_port
from slapo.checkpoints import MARKER

JOB = Path(__file__).resolve().parent / "gathered_checkpoint_job.py"
# gpt2 has dropout (the RNG streams must be restored) and ties its head to the embeddings; the
# linear schedule's learning rate changes every step (the LR schedule must be restored too)
RUN = {"model": "gpt2", "steps": 3, "batch_size": 2, "seq_len": 16, "progress": False,
       "sample": False, "baseline_steps": 0, "compile_model": False, "tensorboard": False,
       "lr_schedule": "linear", "warmup_steps": 1, "output_dir": None}  # fmt: skip


def _check_saved(save: Path, trained: Path) -> None:
    """``save`` is a Hugging Face directory of the ``trained`` weights and their Adam state."""
    assert {p.suffix for p in save.rglob("*") if p.is_file()} == {".json", ".safetensors"}
    assert not list(save.parent.glob(f"{save.name}.rank*"))  # no per-rank directories
    loaded = transformers.AutoModelForCausalLM.from_pretrained(save)
    weights = safetensors.torch.load_file(str(trained))
    state = loaded.state_dict()
    assert weights and set(weights) <= set(state)
    for name, value in weights.items():
        assert torch.equal(state[name], value), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    marker = json.loads((save / MARKER).read_text())
    assert set(marker["optimizer"]["tensors"]) == set(weights)  # Adam state of every parameter
    for per_param in marker["optimizer"]["tensors"].values():
        assert set(per_param) == {"exp_avg", "exp_avg_sq", "step"}


def _same_weights(a: Path, b: Path) -> None:
    """Two runs' trained weights (as :func:`train_keeping_weights` keeps them) are equal."""
    mine, theirs = (safetensors.torch.load_file(str(p)) for p in (a, b))
    assert set(mine) == set(theirs)
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name


def _torchrun(options: dict, trained: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(JOB), json.dumps(options),
           str(trained)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_fsdp_saves_the_whole_model_and_resumes_exactly(tmp_path):
    """On 2 gloo ranks under torchrun: FSDP2's shards saved whole; a run resumed from its
    --save-every step (each rank re-sharding what it reads) has the uninterrupted curve."""
    save, again = tmp_path / "ckpt", tmp_path / "again"
    options = {**RUN, "target": "fsdp"}
    full = _torchrun({**options, "save": str(save), "save_every": 2}, tmp_path / "full.st")
    rest = _torchrun(
        {**options, "resume": str(save / "step-000002"), "save": str(again)}, tmp_path / "rest.st"
    )
    assert rest["resumed_at"] == 2 and len(full["losses"]) == 3
    assert rest["losses"] == full["losses"] and rest["lrs"] == full["lrs"]
    _check_saved(save, tmp_path / "full.st")
    _check_saved(again, tmp_path / "rest.st")
    _same_weights(tmp_path / "full.st", tmp_path / "rest.st")  # the very same trained weights


def test_roundpipe_saves_its_trained_copies_and_resumes_exactly(tmp_path, monkeypatch):
    """One process, 2 virtual RoundPipe devices: the weights RoundPipe's optimizer stepped are
    saved by the model's names; a resumed run restores them and the Adam state exactly."""
    import roundpipe

    monkeypatch.setenv("ROUNDPIPE_VIRTUAL_DEVICES", "2")
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    save = tmp_path / "ckpt"
    options = {**RUN, "target": "roundpipe", "batch_size": 4}  # microbatches over 2 devices
    full = train_keeping_weights(
        {**options, "save": str(save), "save_every": 2}, str(tmp_path / "full.st")
    )
    rest = train_keeping_weights(
        {**options, "resume": str(save / "step-000002"), "save": str(tmp_path / "again")},
        str(tmp_path / "rest.st"),
    )
    assert rest["resumed_at"] == 2 and len(full["losses"]) == 3
    assert rest["losses"] == full["losses"] and rest["lrs"] == full["lrs"]
    assert full["losses"][-1] < full["losses"][0]
    _check_saved(save, tmp_path / "full.st")
    _check_saved(tmp_path / "again", tmp_path / "rest.st")
    _same_weights(tmp_path / "full.st", tmp_path / "rest.st")
    assert roundpipe.get_num_devices() >= 1


def test_a_per_rank_checkpoint_of_an_older_slapo_still_resumes(tmp_path, monkeypatch):
    """RoundPipe's runs were saved per rank (``save_tree``) before: such a checkpoint resumes
    into today's run, which then saves the Hugging Face directory."""
    from dataclasses import replace

    from slapo.checkpoints import TREE_FORMAT
    from slapo.train import TrainConfig, train
    from slapo.train.uses import TARGET_USES

    monkeypatch.setenv("ROUNDPIPE_VIRTUAL_DEVICES", "2")
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    options = {**RUN, "target": "roundpipe", "batch_size": 4}
    full = train(TrainConfig(**options))
    old, new = tmp_path / "old", tmp_path / "new"
    with monkeypatch.context() as m:
        per_rank = replace(TARGET_USES["roundpipe"], checkpoint="per-rank")
        m.setitem(TARGET_USES, "roundpipe", per_rank)
        train(TrainConfig(**{**options, "steps": 2}, save=str(old)))
    assert json.loads((old / MARKER).read_text())["format"] == TREE_FORMAT
    rest = train(TrainConfig(**options, resume=str(old), save=str(new)))
    assert rest["resumed_at"] == 2 and rest["losses"] == full["losses"]
    assert transformers.AutoModelForCausalLM.from_pretrained(new).config.model_type == "gpt2"
