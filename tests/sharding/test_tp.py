"""Tensor parallelism across 2 and 4 gloo processes: equivalence with one process is the oracle.

Spawning a process that imports torch and transformers costs seconds, so each job groups many
checks; each test below reports one check of a job.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import tp_jobs as jobs

import hf_models
import slapo
from dist_utils import check_all, run_workers
from slapo.checkpoints import CheckpointError, load_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp-ckpt"))


@pytest.fixture(scope="module")
def tp2(ckpt_dir):
    return check_all(run_workers(jobs.tp2_job, 2, (ckpt_dir,)))


@pytest.fixture(scope="module")
def tp4(tp2, ckpt_dir):
    return check_all(run_workers(jobs.tp4_job, 4, (ckpt_dir,)))


def assert_check(reports: list[dict], name: str) -> None:
    errors = [f"rank {r}:\n{rep[name]}" for r, rep in enumerate(reports) if rep[name]]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    "check",
    [
        "gpt2",
        "llama",
        "bert",
        "gpt2_padded_vocab_ce",
        "sequence_parallel",
        "fork_rng",
        "bad_input",
        "consolidate",
        "save",
    ],
)
def test_tp2(tp2, check):
    assert_check(tp2, check)


@pytest.mark.parametrize("check", ["gpt2", "bert", "load_tp2_into_tp4", "mesh_2d"])
def test_tp4(tp4, check):
    assert_check(tp4, check)


def _reference_after_step():
    ref = hf_models.make("gpt2", dropout=0.0)
    opt = jobs.train_step(ref)
    return ref, opt


def test_tp2_checkpoint_loads_unsharded(tp2, ckpt_dir):
    ref, ref_opt = _reference_after_step()
    model = hf_models.make("gpt2", seed=5, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    load_checkpoint(model, f"{ckpt_dir}/ckpt", opt)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **jobs.TOL)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"],
            ref_opt.state[ref_params[name]]["momentum_buffer"],
            **jobs.TOL,
        )
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tp2_checkpoint_loads_with_from_pretrained(tp2, ckpt_dir):
    import transformers

    ref, _ = _reference_after_step()
    names = sorted(p.name for p in Path(ckpt_dir, "ckpt").iterdir())
    assert "model.safetensors.index.json" in names  # each rank wrote a share: HF's sharded layout
    assert not [n for n in names if not n.endswith((".json", ".safetensors"))], names
    loaded = transformers.GPT2LMHeadModel.from_pretrained(f"{ckpt_dir}/ckpt")
    ref_params = dict(ref.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **jobs.TOL)


def test_tp2_safetensors_export_loads_in_transformers(tp2, ckpt_dir):
    import transformers

    ref, _ = _reference_after_step()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(f"{ckpt_dir}/hf")
    ref_params = dict(ref.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], **jobs.TOL)


def test_a_rank_that_raises_fails_the_others_quickly(tmp_path):
    start = time.monotonic()
    results = run_workers(jobs.die_job, 2, (str(tmp_path), "raise"), timeout=20, deadline=60)
    assert not results[1]["ok"] and "fails on purpose" in results[1]["error"]
    assert results[0]["ok"], results[0]
    message = results[0]["value"]
    assert "all_reduce" in message and "peer rank" in message, message
    assert time.monotonic() - start < 60


def test_a_killed_save_never_leaves_a_loadable_checkpoint(tmp_path):
    results = run_workers(jobs.die_job, 2, (str(tmp_path), "kill"), timeout=20, deadline=60)
    assert results[1]["error"] == "exit code 3", results[1]
    assert (
        not results[0]["ok"]
        and "SlapoError" in results[0]["error"]
        or "Error" in results[0]["error"]
    )
    model = torch.nn.Linear(4, 4)
    load_checkpoint(model, tmp_path / "ckpt")  # the earlier, complete one is intact
    with pytest.raises(CheckpointError, match="not a complete Slapo checkpoint"):
        load_checkpoint(model, tmp_path / "ckpt_new")


def test_shard_without_a_process_group_is_a_clear_error():
    sch = slapo.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(slapo.SlapoError, match=r'"0".*slapo.env.setup'):
        sch["0"].shard("weight", axis=0)
