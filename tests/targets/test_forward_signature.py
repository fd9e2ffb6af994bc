"""A built model shows the user's ``forward`` signature on every target whose model is called.

Hugging Face ``Trainer`` (and accelerate, Lightning) read ``inspect.signature(model.forward)``:
Trainer keeps only the dataset columns the forward names, so a built model whose forward showed
``(*args, **kwargs)`` got empty batches. Each check builds a tiny GPT-2 with a schedule that
swaps the root's class (a compiled or autocast root) or wraps it (DDP, RoundPipe, DeepSpeed's
engine), asserts the user's signature, and calls ``built(**batch)`` with its keyword names
against the plain model's loss.

The ``"pipeline"`` targets are left out: torch's pipeline engine has no forward (it trains
through ``train_step``), and DeepSpeed's pipeline engine's forward only raises.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch

import hf_models
import slapo
from dist_utils import check_all, run_workers
from slapo.model_schedule import apply_schedule

PG_TIMEOUT = 60.0


def user_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_models.gpt2(dropout=0.0)


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, hf_models.VOCAB, (4, hf_models.SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def check_built(built, user: torch.nn.Module, precision: str | None = None) -> None:
    """``built`` shows ``user``'s signature and ``built(**batch)`` gives the plain model's loss."""
    expected = inspect.signature(type(user).forward.__get__(user))
    assert inspect.signature(built.forward) == expected, str(inspect.signature(built.forward))
    data = batch()
    reference = copy.deepcopy(user)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        want = reference(**data).loss
    got = built(**data).loss
    torch.testing.assert_close(got.float(), want.float())


def test_eager_compiled_root_keeps_the_signature():
    """The recommended schedule compiles the root (a class swap): the signature stays; the
    call itself is the Trainer test's (tests/train/test_hf_trainer.py)."""
    user = user_model()
    sch = apply_schedule(copy.deepcopy(user))
    assert sch.extra["model_schedule"]["compile_model"]
    built, _ = slapo.build(sch)
    assert inspect.signature(built.forward) == inspect.signature(user.forward)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_eager_keeps_the_signature(precision):
    """bf16 swaps the root's class for an autocast one; checkpointed blocks swap theirs."""
    user = user_model()
    sch = apply_schedule(copy.deepcopy(user), ckpt_ratio=1.0)
    built, _ = slapo.build(sch, precision=precision)
    check_built(built, user, precision)


def test_roundpipe_keeps_the_signature():
    user = user_model()
    built, _ = slapo.build(
        slapo.create_schedule(copy.deepcopy(user)), target="roundpipe", num_microbatch=2,
        pin_model="off",
    )  # fmt: skip
    check_built(built, user)
    assert "roundpipe_run_config" not in inspect.signature(built.forward).parameters
    built(**batch(), roundpipe_run_config=None)  # RoundPipe's own keyword still goes through


def _distributed_job(rank: int, world: int) -> list[str]:
    """ddp (fp32 and bf16), fsdp and deepspeed (when installed) on a 1-rank gloo group."""
    checked = []
    user = user_model()
    for precision in (None, "bf16"):
        sch = apply_schedule(copy.deepcopy(user), ckpt_ratio=1.0)
        built, _ = slapo.build(sch, target="ddp", precision=precision)
        check_built(built, user, precision)
        checked.append(f"ddp/{precision}")
    built, _ = slapo.build(slapo.create_schedule(copy.deepcopy(user)), target="fsdp")
    check_built(built, user)
    checked.append("fsdp")
    if importlib.util.find_spec("deepspeed") is not None:
        built, _ = slapo.build(
            slapo.create_schedule(copy.deepcopy(user)), target="deepspeed", zero_stage=1,
            optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
        )  # fmt: skip
        check_built(built, user)
        checked.append("deepspeed")
    return checked


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_distributed_targets_keep_the_signature():
    (checked,) = check_all(run_workers(_distributed_job, 1, timeout=PG_TIMEOUT, deadline=100))
    with_deepspeed = ["deepspeed"] if importlib.util.find_spec("deepspeed") is not None else []
    assert checked == ["ddp/None", "ddp/bf16", "fsdp", *with_deepspeed]
