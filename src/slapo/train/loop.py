"""The training loop of the main job: the same for every build target.

A :class:`Runner` builds the scheduled model for ``cfg.target`` (with the options
:data:`~slapo.train.layout.TARGET_USES` lists) and then runs the training-loop contract of
:mod:`slapo.targets.contract`: ``slapo.train_step(model, batch)``, ``optimizer.step()``,
``optimizer.zero_grad()``. Nothing in the loop names a target.

Example:
    >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))
    >>> len(summary["losses"])
    3
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .. import env
from ..build import build
from ..data import ByteBatches, MaskedByteBatches, default_corpus
from ..schedule import Schedule, create_schedule
from ..sharding import all_reduce
from ..sharding.sequence import SP_TAG
from ..targets import train_step
from .config import TrainConfig
from .layout import TARGET_USES, Layout, setup_layout
from .memory import PeakMemory
from .presets import build_model, default_schedule
from .report import write_outputs
from .state import checkpoint_path, load_state, save_state

__all__ = ["Runner", "make_batches", "run_once", "train"]


def make_batches(cfg: TrainConfig, layout: Layout) -> ByteBatches:
    """This rank's batches of the embedded corpus (masked for BERT).

    Each data-parallel rank draws its own batches; tensor-parallel peers draw the same ones.

    Example:
        >>> make_batches(TrainConfig(batch_size=2, seq_len=16), Layout()).next()["input_ids"].shape
        torch.Size([2, 16])
    """
    cls = MaskedByteBatches if cfg.model == "bert" else ByteBatches
    return cls(default_corpus(), cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1000 * layout.dp_rank)


def _schedule(cfg: TrainConfig, model: nn.Module, layout: Layout, scheduled: bool) -> Schedule:
    if not scheduled:
        return create_schedule(model)
    knobs = {
        "attn_op": cfg.attn_op, "fuse_ops": cfg.fuse_ops, "fused_loss": cfg.fused_loss,
        "sequence_parallel": cfg.sequence_parallel, "num_stages": cfg.num_stages,
    }  # fmt: skip
    if layout.tp_group is not None:
        knobs["group"] = layout.tp_group
    return default_schedule(model, cfg.ckpt_ratio, **knobs)


def _sum_sequence_parallel_grads(model: Any, group: Any) -> None:
    """Sum each gradient of a parameter that sequence parallelism tagged over ``group``, as
    backward computes it (before it is accumulated, so gradient accumulation stays right).

    Sequence-parallel norms and biases see one slice of the sequence per tensor-parallel rank;
    their gradients are partial. ``slapo.sharding.allreduce_sequence_parallel_grads`` sums them
    after backward; as hooks the sum happens inside the backward, for every target alike.
    """
    for p in model.parameters():
        if getattr(p, SP_TAG, False):
            p.register_hook(lambda grad: all_reduce(grad, group))


class Runner:
    """A model built for ``cfg.target`` and its optimizer; :meth:`step` is one training step.

    Example:
        >>> runner = Runner(TrainConfig(), Layout(), scheduled=True)
        >>> loss = runner.step(make_batches(TrainConfig(), Layout()).next())
    """

    def __init__(self, cfg: TrainConfig, layout: Layout, scheduled: bool) -> None:
        self.cfg, self.layout = cfg, layout
        torch.manual_seed(cfg.seed)  # the same initial weights for every run and every rank
        model = build_model(cfg)
        model.train()
        self.sch = _schedule(cfg, model, layout, scheduled)
        options = TARGET_USES[cfg.target].options(cfg, layout)
        self.model, self.optimizer = build(
            self.sch,
            target=cfg.target,
            init_weights=False,
            optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": cfg.lr},
            **options,
        )
        if layout.tp_group is not None:
            _sum_sequence_parallel_grads(self.model, layout.tp_group)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on ``batch``; returns its loss (the training-loop contract)."""
        loss = train_step(self.model, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def run_once(cfg: TrainConfig, layout: Layout, scheduled: bool, label: str) -> dict[str, Any]:
    """Train one model (the scheduled or the unscheduled one); returns its record.

    Example:
        >>> run_once(TrainConfig(steps=2, progress=False), Layout(), True, "scheduled")["label"]
        'scheduled'
    """
    runner = Runner(cfg, layout, scheduled)
    batches = make_batches(cfg, layout)
    record: dict[str, Any] = {"losses": [], "step_tokens_per_s": [], "seconds": 0.0}
    if cfg.resume:
        path = checkpoint_path(cfg.resume, layout.rank, layout.world)
        record = load_state(path, runner.model, runner.optimizer, batches)
    tokens = cfg.batch_size * cfg.seq_len * layout.dp_size
    start = len(record["losses"])
    progress = tqdm(
        total=cfg.steps, initial=start, desc=label, unit="step", dynamic_ncols=True,
        disable=not (cfg.progress and layout.rank == 0),
    )  # fmt: skip
    with PeakMemory(runner.model, runner.optimizer) as mem:
        t_run = time.perf_counter()
        for _ in range(start, cfg.steps):
            t0 = time.perf_counter()
            record["losses"].append(runner.step(batches.next()))
            mem.next_step()
            record["step_tokens_per_s"].append(tokens / (time.perf_counter() - t0))
            progress.set_postfix(
                loss=f"{record['losses'][-1]:.3f}", tok_s=f"{record['step_tokens_per_s'][-1]:,.0f}"
            )
            progress.update()
        record["seconds"] += time.perf_counter() - t_run
    progress.close()
    if cfg.save:
        path = checkpoint_path(cfg.save, layout.rank, layout.world)
        save_state(path, runner.model, runner.optimizer, batches, record)
    losses = record["losses"]
    return {
        "label": label,
        "parameters": sum(p.numel() for p in runner.model.parameters()),
        "primitives": [str(r) + f" @ {r.path}" for r in runner.sch.metadata.primitives],
        "checkpointed_layers": sum(r.name == "checkpoint" for r in runner.sch.metadata.primitives),
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
        "tokens_per_s": _tokens_per_s(record["step_tokens_per_s"]),
        "peak_memory_mb": mem.peak_mb,
        "activation_mb": mem.activation_mb,
        "seconds": record["seconds"],
        "losses": losses,
        "step_tokens_per_s": record["step_tokens_per_s"],
    }


def _tokens_per_s(step_tps: list[float]) -> float:
    """Tokens/s over the steps after the first (which pays one-time warm-up costs)."""
    steady = step_tps[1:] or step_tps
    if not steady:
        return 0.0
    return len(steady) / sum(1.0 / x for x in steady)  # total tokens / total time, per step


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train and return a summary: per-step losses, tokens/s, peak memory (and the baseline's,
    with ``compare``).

    Example:
        >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))
        >>> len(summary["losses"])
        3
    """
    cfg.check()
    started_group = not dist.is_initialized()
    try:
        layout = setup_layout(cfg)
        runs = []
        if cfg.compare:
            runs.append(
                run_once(replace(cfg, save=None), layout, scheduled=False, label="unscheduled")
            )
        runs.append(run_once(cfg, layout, scheduled=not cfg.unscheduled, label="scheduled"))
    finally:
        if started_group and dist.is_initialized():  # leave the process as we found it
            env.teardown()
    summary = {"config": asdict(cfg), "world_size": layout.world, **runs[-1]}
    if cfg.compare:
        summary["baseline"] = runs[0]
    if cfg.output_dir and layout.rank == 0:
        write_outputs(Path(cfg.output_dir), summary, runs)
    return summary
