"""Pipelines built with no example inputs: the stages are built on the first training step.

Run in the suite's 2-rank gloo job. The oracle is the plain PyTorch loop on the unscheduled
model in one process: the loss curve of three steps, and every weight after them (equal weights
after SGD steps mean equal gradients at every step).
"""

from __future__ import annotations

import inspect

import jobs_loop
import torch
import torch.nn.functional as F
from torch import nn

import hf_models
import slapo
from slapo.exceptions import TargetError

STEPS = 3
OPT = {"lr": 0.1}


class MLP(nn.Module):
    """The seed's plain MLP: linear, activation, linear."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class TwoMLPs(nn.Module):
    """Two of them; a stage boundary after the first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp0, self.mlp1 = MLP(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp1(self.mlp0(x))


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def plain_loop(model: nn.Module, batches, loss_of) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain PyTorch loop on one process; the curve and the weights after it."""
    opt = torch.optim.SGD(model.parameters(), **OPT)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, weights


def lazy_loop(sch, batches, loss_fn) -> tuple[list[float], object, torch.optim.Optimizer]:
    """Build with no example inputs, check the optimizer works before any stage, then train."""
    engine, opt = slapo.build(
        sch,
        target="pipeline",
        schedule="1F1B",
        num_microbatches=2,
        loss_fn=loss_fn,
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    assert not engine.built, "the stages were built before the first step"
    # The optimizer is usable before the stages exist: no gradients yet, so this changes nothing.
    assert opt.param_groups and opt.param_groups[0]["params"]
    before = {n: p.detach().clone() for n, p in sch.mod.named_parameters()}
    opt.zero_grad()
    opt.step()
    for n, p in sch.mod.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)  # exact: nothing was applied
    losses = jobs_loop.loop(engine, opt, batches)  # the contract's one training loop
    assert engine.built
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in engine.parameters()}, "the optimizer steps other tensors"
    return losses, engine, opt


def compare(losses, ref_losses, engine, ref_weights) -> None:
    # float32 tolerance: microbatches sum the loss and gradients in another order than one pass
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    names = [n for n, _ in engine.named_parameters()]
    assert names and set(names) <= set(ref_weights), set(names) - set(ref_weights)
    for name, p in engine.named_parameters():
        torch.testing.assert_close(p, ref_weights[name], msg=lambda m, n=name: f"{n}: {m}")


def check_gpt2() -> None:
    """GPT-2 with one cut, trained on mapping batches by the contract's loop."""
    batches = jobs_loop.data()[:STEPS]
    ref_losses, ref_weights = plain_loop(
        hf_models.make("gpt2", dropout=0.0), batches, lambda m, b: m(**b).loss
    )
    assert ref_losses[-1] < ref_losses[0], f"the reference does not learn: {ref_losses}"
    model = hf_models.make("gpt2", dropout=0.0)
    # The parameter between input_ids and attention_mask: the key/value cache, whose name
    # depends on the transformers release (past_key_values, then cache from 5.24).
    gap = list(inspect.signature(model.forward).parameters)[1]
    assert gap in ("past_key_values", "cache"), gap
    sch = slapo.create_schedule(model)
    sch["transformer.h.0"].cut_pipeline_stage()
    losses, engine, _ = lazy_loop(sch, batches, jobs_loop.causal_loss)
    compare(losses, ref_losses, engine, ref_weights)


def check_mlp() -> None:
    """The seed-style plain MLP with a cut, trained on (input, target) tuples."""
    batches = mlp_batches()
    ref_losses, ref_weights = plain_loop(TwoMLPs(), batches, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    sch = slapo.create_schedule(TwoMLPs())
    sch["mlp0"].cut_pipeline_stage()
    losses, engine, _ = lazy_loop(sch, batches, F.mse_loss)
    compare(losses, ref_losses, engine, ref_weights)
    # The stages were built for the first batch's shapes: another shape is named, not run.
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    try:
        slapo.train_step(engine, (x, y))
    except TargetError as exc:
        assert "first batch's shapes" in str(exc), exc
    else:
        raise AssertionError("a batch of another shape ran")


def check_lazy_errors() -> None:
    """What a pipeline waiting for its first batch says about the batch, before any stage runs."""
    model = hf_models.make("gpt2", dropout=0.0)
    # The parameter between input_ids and attention_mask: the key/value cache, whose name
    # depends on the transformers release (past_key_values, then cache from 5.24).
    gap = list(inspect.signature(model.forward).parameters)[1]
    assert gap in ("past_key_values", "cache"), gap
    sch = slapo.create_schedule(model)
    sch["transformer.h.0"].cut_pipeline_stage()
    engine, opt = slapo.build(sch, target="pipeline", num_microbatches=3, loss_fn=F.mse_loss)
    assert opt is None
    batch = jobs_loop.data()[0]
    for bad, text in [
        (batch, "num_microbatches=3"),  # a batch of 4 into 3 microbatches
        ({**batch, "attention_mask": batch["labels"]}, f"but not [{gap!r}]"),
    ]:
        try:
            slapo.train_step(engine, bad)
        except TargetError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"no TargetError mentioning {text}")
    assert not engine.built
    try:
        list(engine.parameters())
    except TargetError as exc:
        assert "optimizer=" in str(exc) and "example_inputs=" in str(exc), exc
    else:
        raise AssertionError("parameters() of unbuilt stages did not say how to get them")


def lazy_checks(rank: int, world: int) -> dict:
    """Checks of the 2-rank job (no stage fails in them: they run before the failing one)."""
    return {
        "lazy_gpt2": check_gpt2,
        "lazy_mlp": check_mlp,
        "lazy_errors": check_lazy_errors,
    }
