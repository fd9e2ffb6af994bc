"""The training-loop contract on every target: ONE loop function, and plain PyTorch as the oracle.

:func:`loop` is the only training loop here; eager and roundpipe run it in the test process,
ddp, fsdp and pipeline in the suite's 2-rank gloo job (``conftest.py``). Each loss curve must be
the curve of the plain PyTorch loop on the unscheduled model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_models
import slapo
from slapo.exceptions import TargetError

STEPS = 6
BATCH = 4
OPT = {"lr": 0.1}  # SGD: Adam would turn summation-order noise into large weight differences


def data() -> list[dict[str, torch.Tensor]]:
    """Two batches in turn: random tokens, yet a curve that falls within a few steps."""
    g = torch.Generator().manual_seed(11)
    two = []
    for _ in range(2):
        ids = torch.randint(1, hf_models.VOCAB, (BATCH, hf_models.SEQ), generator=g)
        two.append({"input_ids": ids, "labels": ids.clone()})
    return [two[i % 2] for i in range(STEPS)]


def causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GPT-2's own loss from the last stage's logits: token t predicts label t + 1."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten())


def loop(model, optimizer, batches) -> list[float]:
    """The training loop of the contract, the same code for every target."""
    losses = []
    for batch in batches:
        losses.append(float(slapo.train_step(model, batch)))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def reference() -> list[float]:
    """The plain PyTorch loop on the unscheduled model: the oracle of every curve."""
    model = hf_models.make("gpt2", dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), **OPT)
    losses = []
    for batch in data():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


# What each target needs beyond the optimizer; the loop above needs nothing per target.
OPTIONS = {
    "eager": {},
    "ddp": {},
    "fsdp": {},
    "roundpipe": {"num_microbatch": 2, "pin_model": "off"},
    "pipeline": {
        "schedule": "1F1B",
        "num_microbatches": 2,
        "loss_fn": causal_loss,
        "example_inputs": (data()[0]["input_ids"],),
    },
}
DATA_PARALLEL = ("ddp", "fsdp")  # each rank trains on its slice of every batch


def curve(target: str, rank: int = 0, world: int = 1) -> list[float]:
    """The loss curve of :func:`loop` on the model built for ``target`` (the batch's mean loss)."""
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    if target == "pipeline":
        sch["transformer.h.0"].cut_pipeline_stage()
    model, opt = slapo.build(
        sch, target=target, optimizer=torch.optim.SGD, optimizer_kwargs=OPT, **OPTIONS[target]
    )
    batches = data()
    if target in DATA_PARALLEL:
        per = BATCH // world
        batches = [{k: v[rank * per : (rank + 1) * per] for k, v in b.items()} for b in batches]
    losses = loop(model, opt, batches)
    if target in DATA_PARALLEL:  # equal slices: the mean of the slices' losses is the batch's
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        losses = (mean / world).tolist()
    return losses


def check(target: str, rank: int = 0, world: int = 1) -> None:
    ref = reference()
    assert ref[-1] < ref[0] - 0.05, f"the reference does not learn: {ref}"
    got = curve(target, rank, world)
    # float32 tolerance: microbatches, slices and all-reduces sum in another order than one pass
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), msg=lambda m: f"{target}: {m}")


def check_pipeline_batches() -> None:
    """The pipeline engine names what it cannot take; it raises before any stage runs."""
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    sch["transformer.h.0"].cut_pipeline_stage()
    engine, _ = slapo.build(sch, target="pipeline", **OPTIONS["pipeline"])
    batch = data()[0]
    for bad, loss_fn, text in [
        ({**batch, "attention_mask": batch["labels"]}, None, "['attention_mask']"),
        ({"input_ids": batch["input_ids"]}, None, '"labels" entry'),
        (batch, causal_loss, "loss_fn= there"),
    ]:
        try:
            slapo.train_step(engine, bad, loss_fn=loss_fn)
        except TargetError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"no TargetError mentioning {text}")
    assert all(p.grad is None for p in engine.parameters())


def loop_checks(rank: int, world: int) -> dict:
    """Checks of the 2-rank job: the one loop on ddp, fsdp and pipeline."""
    checks = {f"loop_{t}": (lambda t=t: check(t, rank, world)) for t in ("ddp", "fsdp", "pipeline")}
    return {**checks, "loop_pipeline_batches": check_pipeline_batches}
