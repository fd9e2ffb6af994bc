"""Tensor parallelism on 2 gloo ranks with selective checkpointing and compiled blocks: one
spawned job of many checks, against the one-process loss and gradients (``check_tp``)."""

from __future__ import annotations

from schedule_jobs import check_tp

from dist_utils import run_checks

FAMILIES = ("gpt2", "llama", "bert", "opt", "t5")
# Every block selectively checkpointed (and compiled: the whole stack of the default schedule;
# a compiled block without checkpoint is checked in one process, where compiling costs half).
SELECTIVE = {"ckpt_ratio": 1.0, "ckpt_policy": "save_matmuls"}
COMPILED = {"ckpt_ratio": 1.0, "ckpt_policy": "save_matmuls", "compile_blocks": True}


def tp_job(rank: int, world: int, compiled: bool) -> dict[str, str | None]:
    knobs = COMPILED if compiled else SELECTIVE
    return run_checks({family: lambda f=family: check_tp(f, **knobs) for family in FAMILIES})
