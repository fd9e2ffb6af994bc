"""Mixed-precision jobs (run in spawned gloo workers): every distributed target in bf16 against
one process in the same precision, and fp16's overflow skipping the step on every rank.

The tolerance of a bf16 comparison (:data:`BF16_REL`): each gradient's relative error
``||g - g_ref|| / ||g_ref||`` and the loss's. bf16 keeps 8 bits of mantissa (a relative rounding
of 2**-8 = 0.4% per value); two ranks computing half batches each round other partial sums than
one process computing the whole batch, so the same math lands up to a few roundings apart. A
gradient that misses a rank's share, or a wrong dtype's math, is off by 10% or far more.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hf_models
import slapo
from slapo.precision import Precision
from slapo.targets.mixed_precision import LossScaledOptimizer, grad_scaler_of

#: The largest relative error of a bf16 gradient or loss against one process in bf16.
BF16_REL = 2e-2
_CAUSAL_LOSS = torch.nn.CrossEntropyLoss()


def _batch(size: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, hf_models.VOCAB, (size, hf_models.SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = batch["input_ids"].shape[0] // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def assert_close_rel(test: torch.Tensor, ref: torch.Tensor, what: str, rel: float = BF16_REL):
    test, ref = test.detach().float(), ref.detach().float()
    err = (test - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel} (bf16 tolerance)"


def reference_step(model: torch.nn.Module, batch, autocast: bool):
    """Loss and gradients of one step on one process: under autocast (``autocast``) or with the
    whole model in bf16 (what FSDP2's param_dtype computes with)."""
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
    else:
        model = model.to(torch.bfloat16)
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_bf16(target: str, rank: int, world: int) -> None:
    """``slapo.build(..., target, precision="bf16")``: the loss and every gradient equal one
    process's in bf16 within :data:`BF16_REL`; the master weights and their gradients stay
    float32."""
    model = hf_models.make("llama", dropout=0.0)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), _batch(), target != "fsdp")
    built, opt = slapo.build(
        slapo.create_schedule(model), target=target, precision="bf16",
        optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
    )  # fmt: skip
    with torch.no_grad():  # the forward computes in bf16
        logits = built(**_slice(_batch(), rank, world)).logits
    assert logits.dtype == torch.bfloat16, f"{target}: the forward computed in {logits.dtype}"
    loss = slapo.train_step(built, _slice(_batch(), rank, world)).float()
    dist.all_reduce(loss)
    assert_close_rel(loss / world, ref_loss, f"{target} loss")
    for name, p in built.named_parameters():
        name = name.removeprefix("module.")
        assert p.dtype == torch.float32, f"{target}: master weight {name} is {p.dtype}"
        assert p.grad.dtype == torch.float32, f"{target}: gradient of {name} is {p.grad.dtype}"
        assert_close_rel(_full(p.grad), ref_grads[name], f"{target} gradient of {name}")
    opt.step()


def check_pipeline_bf16(rank: int, world: int) -> None:
    """Two pipeline stages, each autocast: the loss and every gradient equal one process's."""
    model = hf_models.make("llama", dropout=0.0)
    batch = _batch()
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ref(input_ids=batch["input_ids"]).logits
    ref_loss = _CAUSAL_LOSS(logits.float().flatten(0, 1), batch["labels"].flatten())
    ref_loss.backward()
    sch = slapo.create_schedule(model)
    sch[f"{hf_models.LAYERS['llama']}.0"].cut_pipeline_stage()

    def loss_fn(out, target):
        return _CAUSAL_LOSS(out.float().flatten(0, 1), target.flatten())

    engine, opt = slapo.build(
        sch, target="pipeline", schedule="GPipe", num_microbatches=2, loss_fn=loss_fn,
        precision="bf16", optimizer=torch.optim.AdamW,
    )  # fmt: skip
    # microbatches average their losses: the same mean as the whole batch's
    loss = slapo.train_step(engine, batch)
    assert_close_rel(loss, ref_loss.detach(), "pipeline loss")
    grads = dict(ref.named_parameters())
    for name, p in engine.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert_close_rel(p.grad, grads[name].grad, f"pipeline gradient of {name}")
    opt.step()


def check_fp16_overflow(target: str, rank: int, world: int) -> None:
    """fp16: a gradient that overflows on rank 0 only makes every rank skip the step (weights
    unchanged) and halve its loss scale; the next step trains on every rank."""
    model = hf_models.make("llama", dropout=0.0)
    built, opt = slapo.build(
        slapo.create_schedule(model), target=target, precision="fp16",
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip
    assert isinstance(opt, LossScaledOptimizer)
    scaler = grad_scaler_of(built)
    scale = scaler.get_scale()
    before = {n: _full(p).detach().clone() for n, p in built.named_parameters()}
    slapo.train_step(built, _slice(_batch(), rank, world))
    if rank == 0:  # an overflow on one rank only
        p = next(p for p in built.parameters() if p.grad is not None)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grad.view(-1)[0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert scaler.get_scale() == scale / 2, (scaler.get_scale(), scale)
    for name, p in built.named_parameters():
        assert torch.equal(_full(p).detach(), before[name]), f"{target}: {name} stepped"
    slapo.train_step(built, _slice(_batch(), rank, world))
    opt.step()
    assert scaler.get_scale() == scale / 2
    moved = [n for n, p in built.named_parameters() if not torch.equal(_full(p), before[n])]
    assert moved, f"{target}: the step after the skipped one trained nothing"


def precision_checks(rank: int, world: int) -> dict:
    """The 2-rank checks of mixed precision, by name (``dist_utils.run_checks``)."""
    return {
        "bf16 ddp": lambda: check_bf16("ddp", rank, world),
        "bf16 fsdp": lambda: check_bf16("fsdp", rank, world),
        "bf16 pipeline": lambda: check_pipeline_bf16(rank, world),
        "fp16 overflow ddp": lambda: check_fp16_overflow("ddp", rank, world),
        "fp16 overflow fsdp": lambda: check_fp16_overflow("fsdp", rank, world),
    }


__all__ = ["BF16_REL", "Precision", "precision_checks"]
