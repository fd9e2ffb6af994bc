"""The training loop of the main job: the same for every build target.

A :class:`Runner` builds the scheduled model for ``cfg.target`` (with the options
:data:`~slapo.train.job_layout.TARGET_USES` lists) and then runs the training-loop contract of
:mod:`slapo.targets.contract`: ``slapo.train_step(model, batch)``, ``optimizer.step()``,
``optimizer.zero_grad()``. Nothing in the loop names a target.

Example:
    >>> from slapo.train import TrainConfig, train
    >>> # illustration: three real training steps take 10-30 seconds on a CPU
    >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))  # doctest: +SKIP
    >>> len(summary["losses"])  # doctest: +SKIP
    3
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from .. import env
from ..build import build
from ..data import ByteBatches, MaskedByteBatches, MaskedTokenBatches, TokenBatches, default_corpus
from ..sharding import all_reduce
from ..sharding.sequence import SP_TAG
from ..sharding.sync_ops import on_named_param_grads
from ..targets import train_step
from ..throughput import device_peak_tflops, mfu, model_flops_per_token
from .config import TrainConfig
from .evaluation import Evaluator, eval_batches, wants_eval
from .events import Events, open_events
from .generic_schedule import describe_plan
from .inputs import RunInputs, prepare_inputs
from .job_layout import Layout, schedule_for, schedule_knobs, setup_layout
from .lr_schedule import make_scheduler
from .presets import build_model
from .report import write_outputs
from .run import ResolvedRun, resolve_run
from .run_memory import PeakMemory, estimate_run, estimated_peak_mb, local_part
from .sample import sample_text
from .state import (
    RunState,
    check_resume,
    check_save,
    load_run,
    model_identity,
    new_record,
    nothing_to_resume,
    prune_steps,
    save_run,
    step_dir,
)

#: Steps whose saved bytes :class:`PeakMemory` counts (the rest run without its hooks).
MEMORY_SAMPLE_STEPS = 3

__all__ = ["Runner", "make_batches", "run_once", "train"]


def make_batches(
    cfg: TrainConfig, layout: Layout, inputs: RunInputs | None = None
) -> ByteBatches | TokenBatches:
    """This rank's batches of the run's tokens: ``inputs.tokens`` (``--data``), else the
    embedded corpus as bytes (masked for BERT).

    The global batch is ``--batch-size`` x dp, drawn as one process with that batch size draws
    it; each data-parallel rank trains on its own slice of it, so a run on dp replicas follows
    the loss curve of one process with dp times the batch. Tensor-parallel and pipeline peers
    take the same slice.

    Example:
        >>> from slapo.train import TrainConfig
        >>> from slapo.train.job_layout import Layout
        >>> make_batches(TrainConfig(batch_size=2, seq_len=16), Layout()).next()["input_ids"].shape
        torch.Size([2, 16])
    """
    size = cfg.batch_size * layout.dp_size
    if inputs is not None and inputs.tokens is not None:
        tokens = MaskedTokenBatches if cfg.model == "bert" else TokenBatches
        batches = tokens(inputs.tokens, size, cfg.seq_len, seed=cfg.seed)
    else:
        cls = MaskedByteBatches if cfg.model == "bert" else ByteBatches
        corpus = inputs.corpus if inputs is not None and inputs.corpus is not None else None
        batches = cls(corpus or default_corpus(), size, cfg.seq_len, seed=cfg.seed)
    if layout.dp_size == 1:
        return batches
    return ReplicaSlice(batches, layout.dp_rank, cfg.batch_size)


class ReplicaSlice:
    """One data-parallel rank's rows of the global batches of ``batches`` (with their state).

    Example:
        >>> from slapo.data import ByteBatches, default_corpus
        >>> corpus = default_corpus()
        >>> ReplicaSlice(ByteBatches(corpus, 4, 8), rank=1, rows=2).next()["input_ids"].shape
        torch.Size([2, 8])
    """

    def __init__(self, batches: Any, rank: int, rows: int) -> None:
        self.batches, self.rows = batches, slice(rank * rows, (rank + 1) * rows)

    def next(self) -> dict[str, torch.Tensor]:
        return {k: v[self.rows] for k, v in self.batches.next().items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.batches.load_state_dict(state)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``: to a GPU from pinned host memory, without blocking the host.

    Example:
        >>> to_device({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, torch.device("cpu"))
        {'input_ids': tensor([[0, 0, 0, 0],
                [0, 0, 0, 0]])}
    """
    if device.type == "cpu":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def _sum_sequence_parallel_grads(model: nn.Module, group: Any) -> None:
    """Sum each gradient of a parameter that sequence parallelism tagged over ``group``, as
    backward computes it (before it is accumulated, so gradient accumulation stays right).

    Sequence-parallel norms and biases see one slice of the sequence per tensor-parallel rank;
    their gradients are partial. ``slapo.sharding.allreduce_sequence_parallel_grads`` sums them
    after backward; as hooks the sum happens inside the backward, for every target alike. They
    are set before the build, by module and parameter name: a target that swaps the parameter
    objects (FSDP2's sharded and unsharded parameters) keeps them.
    """
    for mod in model.modules():
        names = [n for n, p in mod.named_parameters(recurse=False) if getattr(p, SP_TAG, False)]
        if names:
            on_named_param_grads(mod, names, lambda grad: all_reduce(grad, group))


class Runner:
    """A model built for ``cfg.target``, its optimizer and learning-rate scheduler;
    :meth:`step` is one training step.

    Example:
        >>> from slapo.train import TrainConfig
        >>> from slapo.train.job_layout import Layout
        >>> cfg = TrainConfig(batch_size=2, seq_len=16)
        >>> runner = Runner(cfg, Layout(), scheduled=True)
        >>> # illustration: the first step compiles the scheduled layers, seconds on a CPU
        >>> loss = runner.step(make_batches(cfg, Layout()).next())  # doctest: +SKIP
    """

    def __init__(
        self, cfg: TrainConfig, layout: Layout, scheduled: bool, run: ResolvedRun | None = None
    ) -> None:
        self.cfg, self.layout = cfg, layout
        self.run = run = run or resolve_run(cfg)
        torch.manual_seed(cfg.seed)  # the same initial weights for every run and every rank
        model = build_model(cfg)
        model.train()
        # counted whole, before tensor parallelism shards the weights or an engine wraps them
        self.flops_per_token = model_flops_per_token(model, cfg.seq_len)
        self.sch = schedule_for(cfg, model, layout, scheduled)
        if layout.tp_group is not None:
            _sum_sequence_parallel_grads(self.sch.mod, layout.tp_group)
        # attention over the cp ranks, experts split over the ep ranks (None: one process)
        mesh = layout.parallel_mesh
        self.context = None if mesh is None else mesh.apply(self.sch.mod)
        self.target = run.target
        options = {**run.use.options(cfg, layout), **run.build_options()}  # device, precision
        self.model, self.optimizer = build(
            self.sch,
            target=self.target,
            init_weights=False,
            optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": cfg.lr},
            **options,
        )
        self.scheduler = make_scheduler(self.optimizer, cfg)

    def lr(self) -> float:
        """The learning rate the next step trains at."""
        groups = getattr(self.optimizer, "param_groups", None)
        return float(groups[0]["lr"]) if groups else self.cfg.lr

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on ``batch``; returns its loss (the training-loop contract)."""
        batch = to_device(batch, self.run.batch_device)
        if self.context is not None:  # this rank's part of each sequence
            batch = self.context.model_batch(batch)
        loss = train_step(self.model, batch).detach()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.layout.replicas > 1:  # the global batch's loss: the mean over dp x cp
            loss = loss.float().clone()
            dist.all_reduce(loss, group=self.layout.grad_group.get_group())
            loss /= self.layout.replicas
        return float(loss)

    def state(
        self, batches: Any, record: dict[str, Any], identity: dict[str, Any], inputs: RunInputs
    ) -> RunState:
        """What a checkpoint of this run holds (:mod:`slapo.train.state`)."""
        return RunState(
            self.cfg, self.sch.mod, self.model, self.optimizer, self.scheduler, batches, record,
            self.layout.rank, self.layout.world, self.run.use.checkpoint or "",
            identity, inputs.tokenizer,
        )  # fmt: skip


class _Watch:
    """What the main run does besides training: evaluate, write TensorBoard events, save
    checkpoints (every ``--save-every`` steps and at the end). The short baseline does none."""

    def __init__(
        self, cfg: TrainConfig, runner: Runner, inputs: RunInputs, state: Callable[[], RunState]
    ) -> None:
        self.cfg, self.runner, self.state = cfg, runner, state
        has_eval = inputs.eval_tokens is not None
        self.evaluator = Evaluator(eval_batches(cfg, inputs)) if has_eval else None
        self.events = Events(None)

    def start(self, step: int) -> None:
        """Open the event file (rank 0, once a resumed state has loaded: at ``step``)."""
        cfg = self.cfg
        if self.runner.layout.rank == 0 and cfg.output_dir and cfg.tensorboard:
            self.events = open_events(Path(cfg.output_dir), step)

    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Record step ``step`` (1-based) and evaluate and save where the flags say."""
        self.events.add(step, {"train/loss": record["losses"][-1], "train/lr": record["lrs"][-1],
                               "train/tokens_per_s": record["step_tokens_per_s"][-1]})  # fmt: skip
        if self.evaluator is not None and wants_eval(self.cfg, step):
            result = {"step": step, **self.evaluator(self.runner.model)}
            record["eval"].append(result)
            self.events.add(step, {"eval/loss": result["loss"],
                                   "eval/perplexity": result["perplexity"]})  # fmt: skip
        every, save = self.cfg.save_every, self.cfg.save
        if save and every and step % every == 0 and step < self.cfg.steps:
            save_run(step_dir(save, step), self.state(), final=False)
            if self.runner.layout.rank == 0:
                prune_steps(save, self.cfg.keep)

    def finish(self) -> None:
        """Close the event file; the final ``--save``."""
        self.events.close()
        if self.cfg.save:
            save_run(Path(self.cfg.save), self.state())


def run_once(
    cfg: TrainConfig,
    layout: Layout,
    scheduled: bool,
    label: str,
    inputs: RunInputs | None = None,
    watch: bool = True,
    run: ResolvedRun | None = None,
) -> dict[str, Any]:
    """Train one model (the scheduled or the unscheduled one) on ``inputs`` (default: prepared
    from ``cfg``); returns its record. A ``watch``ed run (the main one, not a short baseline)
    resumes, evaluates, saves checkpoints and writes TensorBoard events as ``cfg`` says.

    Example:
        >>> from slapo.train import TrainConfig
        >>> from slapo.train.job_layout import Layout
        >>> # illustration: two real training steps of the compiled model take seconds on a CPU
        >>> run_once(TrainConfig(steps=2, progress=False), Layout(), True, "scheduled")["label"]  # doctest: +SKIP
        'scheduled'
    """
    inputs = inputs or prepare_inputs(cfg)
    if not watch:
        cfg = replace(cfg, save=None, resume=None)
    identity = model_identity(cfg) if cfg.save or cfg.resume else {}
    resume = check_resume(cfg, layout.rank, layout.world, identity) if cfg.resume else None
    runner = Runner(cfg, layout, scheduled, run)
    batches = make_batches(cfg, layout, inputs)
    estimate = estimate_run(runner, batches)  # before any step: a prediction, not a reading
    record = new_record()
    state = lambda: runner.state(batches, record, identity, inputs)  # noqa: E731
    if resume is not None:
        record.update(load_run(resume, state()))
    watcher = _Watch(cfg, runner, inputs, state) if watch else None
    tokens = cfg.batch_size * cfg.seq_len * layout.dp_size
    start = len(record["losses"])
    if watcher is not None:
        watcher.start(start)
    progress = tqdm(
        total=cfg.steps, initial=start, desc=label, unit="step", dynamic_ncols=True,
        disable=not (cfg.progress and layout.rank == 0),
    )  # fmt: skip
    # saved bytes are counted in the first steps only (the shapes never change), so that the
    # hooks that count them do not slow the steps whose tokens/s is reported
    with PeakMemory(runner.model, runner.optimizer, sample_steps=MEMORY_SAMPLE_STEPS) as mem:
        t_run = time.perf_counter()
        for step in range(start + 1, cfg.steps + 1):
            record["lrs"].append(runner.lr())
            t0 = time.perf_counter()
            record["losses"].append(runner.step(batches.next()))
            mem.next_step()
            record["step_tokens_per_s"].append(tokens / (time.perf_counter() - t0))
            if watcher is not None:
                watcher.after_step(step, record)
            progress.set_postfix(
                loss=f"{record['losses'][-1]:.3f}", tok_s=f"{record['step_tokens_per_s'][-1]:,.0f}"
            )
            progress.update()
        record["seconds"] += time.perf_counter() - t_run
    progress.close()
    if watcher is not None:
        watcher.finish()
    # what this rank holds: a DTensor (FSDP2, Hugging Face's TP plan) counts its local shard
    parameters = sum(local_part(p).numel() for p in runner.model.parameters())
    curve = _curve(record)
    peak = _peak_tflops(cfg, runner.run)
    return {
        "label": label,
        "knobs": schedule_knobs(cfg) if scheduled else None,
        "plan": describe_plan(runner.sch),
        "sample": _sample(cfg, layout, runner, inputs) if scheduled and cfg.sample else None,
        "parameters": parameters,
        "layout": layout.describe(),
        "target": runner.target,
        "device": str(runner.run.device),
        "precision": runner.run.precision.name,
        "placement": runner.run.describe(),
        "ranks": _per_rank(layout, parameters, mem.peak_mb, estimated_peak_mb(estimate)),
        "primitives": [str(r) + f" @ {r.path}" for r in runner.sch.metadata.primitives],
        "checkpointed_layers": sum(r.name == "checkpoint" for r in runner.sch.metadata.primitives),
        "peak_memory_mb": mem.peak_mb,
        "activation_mb": mem.activation_mb,
        "estimated_peak_mb": estimated_peak_mb(estimate),
        "estimate": None if estimate is None else estimate.as_dict(),
        **curve,
        "flops_per_token": runner.flops_per_token,
        "peak_tflops": peak,
        "mfu": mfu(curve["tokens_per_s"], runner.flops_per_token, peak, num_devices=layout.world),
        "resumed_from": None if resume is None else str(resume),
        "resumed_at": start if resume is not None else None,
        "saved": cfg.save,
    }


def _peak_tflops(cfg: TrainConfig, run: ResolvedRun) -> float | None:
    """The device's dense peak in the run's precision: ``--peak-tflops``, else the table of
    common GPUs (:mod:`slapo.throughput`); None on the CPU."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops
    return device_peak_tflops(run.device, run.precision.name)


def _per_rank(
    layout: Layout, parameters: int, peak_mb: float, estimate_mb: float | None
) -> list[dict[str, Any]]:
    """Each rank's parameters held, measured peak and estimate (MiB), gathered on every rank.

    Gathered as one float64 tensor per rank (no pickled objects between processes).
    """
    mine = torch.tensor(
        [parameters, peak_mb, float("nan") if estimate_mb is None else estimate_mb],
        dtype=torch.float64,
    )
    rows = [mine]
    if layout.world > 1:
        rows = [torch.empty_like(mine) for _ in range(layout.world)]
        dist.all_gather(rows, mine)
    return [
        {"rank": r, "parameters": int(row[0]), "peak_memory_mb": float(row[1]),
         "estimated_peak_mb": None if row[2].isnan() else float(row[2])}
        for r, row in enumerate(rows)
    ]  # fmt: skip


def _curve(record: dict[str, Any]) -> dict[str, Any]:
    """The run's summary entries of its record: losses, learning rates, tokens/s, evaluations."""
    losses = record["losses"]
    last_eval = record["eval"][-1] if record["eval"] else {}
    return {
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
        "tokens_per_s": _tokens_per_s(record["step_tokens_per_s"]),
        "seconds": record["seconds"],
        "losses": losses,
        "lrs": record["lrs"],
        "step_tokens_per_s": record["step_tokens_per_s"],
        "eval": record["eval"],
        "eval_loss": last_eval.get("loss"),
        "eval_perplexity": last_eval.get("perplexity"),
    }


def _sample(
    cfg: TrainConfig, layout: Layout, runner: Runner, inputs: RunInputs
) -> list[str] | None:
    """Text the trained model writes (rank 0; None on other ranks and targets that shard or
    stream the weights)."""
    if layout.rank != 0 or not runner.run.use.samples or cfg.tp > 1:
        return None
    family = cfg.model if inputs.source.kind == "family" else "causal"
    return sample_text(
        runner.sch.mod, family, seed=cfg.seed, tokenizer=inputs.tokenizer, prompt=inputs.prompt
    )


def _tokens_per_s(step_tps: list[float]) -> float:
    """Tokens/s over the steps after the first (which pays one-time warm-up costs)."""
    steady = step_tps[1:] or step_tps
    if not steady:
        return 0.0
    return len(steady) / sum(1.0 / x for x in steady)  # total tokens / total time, per step


def _short_baseline(cfg: TrainConfig, run: ResolvedRun) -> bool:
    """Whether the run measures a short unscheduled baseline first: not for an unscheduled run,
    nor on a target without one (``TargetUse.baseline``: the pipeline's stages come from the
    schedule's cuts). It runs on the same device in the same precision."""
    return cfg.baseline_steps > 0 and not cfg.unscheduled and run.use.baseline


class _KnownCheckpointNotice(logging.Filter):
    """Drops dynamo's notice that a selective checkpoint is compiled (it asks to avoid in-place
    ops there): the ready schedules' selective checkpoints are compiled by design and tested
    equal to eager training for every family."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


_KNOWN_NOTICE = _KnownCheckpointNotice()


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train and return a summary: per-step losses, tokens/s, peak memory (and the baseline's,
    with ``compare``).

    Example:
        >>> from slapo.train import TrainConfig
        >>> # illustration: three real training steps take 10-30 seconds on a CPU
        >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))  # doctest: +SKIP
        >>> len(summary["losses"])  # doctest: +SKIP
        3
    """
    cfg.check()
    run = resolve_run(cfg)  # target, device and precision: decided once
    inputs = prepare_inputs(cfg)  # every input checked before anything is built or written
    logging.getLogger("torch._higher_order_ops.wrap").addFilter(_KNOWN_NOTICE)
    started_group = not dist.is_initialized()
    try:
        layout = setup_layout(cfg, run)
        if run.use.checkpoint == "full":  # replaced whole by the save
            check_save(cfg)
        if cfg.resume and nothing_to_resume(cfg.resume, layout.rank, layout.world):
            if layout.rank == 0:
                print(
                    f"slapo train: --resume {cfg.resume}: no checkpoint there yet; "
                    "starting from step 0",
                    file=sys.stderr,
                )  # fmt: skip
            cfg = replace(cfg, resume=None)
        if cfg.resume:  # a checkpoint of this model, before the baseline trains
            check_resume(cfg, layout.rank, layout.world, model_identity(cfg))
        runs = []
        if cfg.compare:
            unscheduled = replace(cfg, save=None, resume=None)
            runs.append(
                run_once(unscheduled, layout, False, "unscheduled", inputs, watch=False, run=run)
            )
        elif _short_baseline(cfg, run):  # a few eager steps: tokens/s and memory, side by side
            short = replace(
                cfg, steps=min(cfg.baseline_steps, cfg.steps), save=None, resume=None
            )  # fmt: skip
            runs.append(run_once(short, layout, False, "unscheduled", inputs, watch=False, run=run))
        runs.append(run_once(cfg, layout, not cfg.unscheduled, "scheduled", inputs, run=run))
    finally:
        if started_group and dist.is_initialized():  # leave the process as we found it
            env.teardown()
    summary = {
        "config": asdict(cfg), "world_size": layout.world, **inputs.describe(), **runs[-1]
    }  # fmt: skip
    if len(runs) > 1:
        summary["baseline"] = runs[0]
    if cfg.output_dir and layout.rank == 0:
        write_outputs(Path(cfg.output_dir), summary, runs)
    return summary
