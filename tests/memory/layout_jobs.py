"""Spawned gloo jobs: each rank estimates its share of a layout (``slapo.estimate_layout``) and
measures a real step of the same build target to check it.

The measurement, independent of the planner: the rank's model state as its engine holds it after
a real step (parameter, gradient and optimizer-state storages), the engine's own buffers read
from the engine (``slapo.memory.EngineBytes``: DDP's buckets, FSDP2's gathered parameters,
DeepSpeed's fp32 partition), plus the most bytes *saved for backward alive at once*
(``slapo.memory.LiveSaved``): every tensor autograd saves is counted when packed (one count per
storage, parameters excluded) and uncounted when its storage is freed (``weakref.finalize``).
The latter is what a pipeline schedule keeps in flight: GPipe holds every microbatch's saved
tensors until its backwards run; 1F1B frees one before the next forward. A one-process step (``tests/memory/measure.py``) counts them all at once instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn

import slapo
from slapo.memory import EngineBytes, LiveSaved

VOCAB, SEQ, BATCH, LAYERS = 96, 64, 8, 4


def make_model() -> nn.Module:
    """A GPT-2 whose activations weigh as much as its parameters (no dropout: same every run)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).train()


def make_batch(size: int = BATCH, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _state_bytes(opt: Any) -> int:
    state = getattr(opt, "optimizer", opt).state  # RoundPipe wraps the optimizer it steps
    return _storage_bytes(
        v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()
    ) + sum(  # the step counts (0-dim) are not shared: one storage each
        v.untyped_storage().nbytes() for s in state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and not v.dim()
    )  # fmt: skip


def _report(est: Any, measured: dict[str, int]) -> dict[str, Any]:
    return {
        "est": {k: getattr(est, k) for k in (
            "params", "buffers", "grads", "optimizer_state", "activations", "engine", "peak",
            "device_resident")},
        "engine_parts": dict(est.engine_parts),
        "real": {**measured, "peak": sum(v for k, v in measured.items() if k != "resident")},
        "stage": est.stage,
    }  # fmt: skip


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


# ----- data parallel: ddp, fsdp, deepspeed ZeRO-2 -------------------------------------------------
def data_parallel(rank: int, world: int) -> dict[str, Any]:
    """Per engine: this rank's estimate and measurement of one step on its slice of the batch."""
    out = {}
    batch = make_batch(seed=rank)
    for target in ("ddp", "fsdp", "deepspeed"):
        sch = slapo.create_schedule(make_model())
        opts = {"zero_stage": 2, "micro_batch_size": BATCH} if target == "deepspeed" else {}
        est = slapo.estimate_layout(
            sch, batch, target=target, dp=world, rank=rank, optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": 1e-3},
        )  # fmt: skip
        model, opt = slapo.build(
            sch, target=target, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3}, **opts
        )  # fmt: skip
        out[target] = _report(est, _measure_data_parallel(target, model, opt, batch))
    return out


def _measure_data_parallel(target: str, model: Any, opt: Any, batch: Any) -> dict[str, int]:
    engine = EngineBytes(model)  # the engine's buffers, read from it
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}

    def skip() -> set[int]:  # the parameters, held or gathered, are not saved tensors
        return params | engine.skip()

    for _step in range(2):  # the second step: the optimizer state is there from its start
        live = LiveSaved(skip, engine.sample)
        with live:
            slapo.train_step(model, batch)
        engine.sample()
        if target == "deepspeed":
            zero = opt.optimizer if hasattr(opt, "optimizer") else opt
            zero = getattr(model, "optimizer", zero)
            grads = _storage_bytes(
                [zero.grads_in_partition] if getattr(zero, "grads_in_partition", None) is not None
                else [g for g in zero.averaged_gradients.values() for g in g]
            )  # fmt: skip
            held = _storage_bytes(zero.bit16_groups_flat)
        else:
            grads = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
            held = _storage_bytes(model.parameters())
        parts = engine.parts()
        opt.step()
        opt.zero_grad()
    return {
        "params": held, "buffers": _storage_bytes(model.buffers()), "grads": grads,
        "optimizer_state": _state_bytes(opt), "activations": live.peak, **parts,
    }  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ----- pipeline: GPipe and 1F1B --------------------------------------------------------------------
CUTS = ["transformer.h.1"]
MICRO = 4


def causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten())


def pipeline(rank: int, world: int) -> dict[str, Any]:
    """Per schedule: this stage's estimate and measurement of one step of ``MICRO`` microbatches."""
    out = {}
    batch = make_batch()
    for schedule in ("GPipe", "1F1B"):
        sch = slapo.create_schedule(make_model())
        for path in CUTS:
            sch[path].cut_pipeline_stage()
        est = slapo.estimate_layout(
            sch, batch, target="pipeline", pp=world, rank=rank, num_microbatches=MICRO,
            pipeline_schedule=schedule, optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": 1e-3},
        )  # fmt: skip
        engine, opt = slapo.build(
            sch, target="pipeline", schedule=schedule, num_microbatches=MICRO,
            loss_fn=causal_loss, example_inputs=(batch["input_ids"],),
            optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
        )  # fmt: skip
        measured = _measure_pipeline(engine, opt, batch["input_ids"], batch["labels"])
        out[schedule] = _report(est, measured)
    return out


def _measure_pipeline(
    engine: Any, opt: Any, inputs: torch.Tensor, labels: torch.Tensor
) -> dict[str, int]:
    """A stage's bytes in the second of two steps: one count over both steps, so that what the
    first leaves alive (the first stage's shape-inference forward) counts in the second."""
    params = list(engine.parameters())
    live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in params})
    for _ in range(2):
        live.reset_peak()
        with live:
            engine.step(inputs, target=labels)
        grads = _storage_bytes(p.grad for p in params if p.grad is not None)
        opt.step()
        opt.zero_grad()
    return {
        "params": _storage_bytes(params), "buffers": 0,  # the engine exposes no buffers
        "grads": grads, "optimizer_state": _state_bytes(opt), "activations": live.peak,
    }  # fmt: skip


# ----- a slapo train llama stage: the default model, its ready schedule --------------------------
def llama_pipeline(rank: int, world: int) -> dict[str, Any]:
    """Per ``ckpt_ratio`` (0, and the default selective checkpointing): this stage's estimate as
    ``slapo train`` makes it (``estimate_config``) and the measurement of the stage that
    ``slapo train --pp 2`` builds (its model, ready schedule, 1F1B over 2 microbatches)."""
    from slapo.train import TrainConfig
    from slapo.train.job_layout import Layout, schedule_for
    from slapo.train.presets import build_model, causal_lm_loss
    from slapo.train.run_memory import estimate_config

    out = {}
    ids = make_batch(seed=1)["input_ids"] % 256  # the bytes tokenizer's vocabulary
    for ratio in (0.0, None):
        cfg = TrainConfig(pp=world, batch_size=BATCH, seq_len=SEQ, ckpt_ratio=ratio)
        est = estimate_config(cfg, rank=rank)
        torch.manual_seed(0)
        sch = schedule_for(cfg, build_model(cfg).train(), Layout(), scheduled=True)
        engine, opt = slapo.build(
            sch, target="pipeline", schedule=cfg.pipeline_schedule,
            num_microbatches=cfg.num_microbatches, loss_fn=causal_lm_loss,
            example_inputs=(ids,), optimizer=torch.optim.AdamW,
            optimizer_kwargs={"lr": cfg.lr},
        )  # fmt: skip
        checkpointed = sum(r.name == "checkpoint" for r in sch.metadata.primitives)
        report = _report(est, _measure_pipeline(engine, opt, ids, ids))
        out["default" if ratio is None else "none"] = {**report, "checkpointed": checkpointed}
    return out


# ----- roundpipe: the device's memory account ------------------------------------------------------
def roundpipe(precision: str = "fp32") -> dict[str, Any]:
    """RoundPipe on its virtual CPU devices (``ROUNDPIPE_VIRTUAL_DEVICES``; uploads prefetched
    with ``ROUNDPIPE_VIRTUAL_LINK_GBPS``): the estimate's ``device_resident`` and the most bytes
    any device's memory account held in a step, in ``precision`` (bf16: the layers stream in
    bf16)."""
    from roundpipe.device import get_devices, prefetch_enabled

    devices = len(get_devices())
    prefetch = prefetch_enabled() and all(d.async_copies for d in get_devices())
    batch = make_batch()
    sch = slapo.create_schedule(make_model())
    for path in ("transformer.h.0", "transformer.h.2"):
        sch[path].cut_pipeline_stage()
    est = slapo.estimate_layout(
        sch, batch, target="roundpipe", devices=devices, prefetch=prefetch, optimizer=_adamw,
        precision=precision,
    )  # fmt: skip
    model, opt = slapo.build(
        sch, target="roundpipe", num_microbatch=2, optimizer=_adamw, precision=precision
    )
    for _ in range(2):
        for device in get_devices():
            device.memory.reset_peak()
        slapo.train_step(model, batch)
        opt.step()
        opt.zero_grad()
    return {
        "est": est.device_resident,
        "real": max(d.memory.peak for d in get_devices()),
        "devices": devices,
        "prefetch": prefetch,
    }


def roundpipe_job(rank: int, world: int) -> dict[str, Any]:
    """:func:`roundpipe` in a fresh process (RoundPipe reads its devices' settings once), in
    fp32 and in bf16."""
    return {precision: roundpipe(precision) for precision in ("fp32", "bf16")}
