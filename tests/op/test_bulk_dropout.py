"""Dropout masks drawn in bulk (``slapo.op.dropout``) and the ``compile(rng="bulk")`` lowering:
the mask's law, its reproducibility, and a compiled region equal to its eager code drawing the
same masks (``bulk_dropout_masks``)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from slapo.exceptions import PrimitiveError
from slapo.op.dropout import bulk_dropout, bulk_dropout_masks, bulk_keep_mask, quantized_p


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_mask_has_the_bernoulli_law(p):
    torch.manual_seed(0)
    n = 1 << 20
    dropped = ~bulk_keep_mask((n,), p)
    q = quantized_p(p)
    sigma = math.sqrt(q * (1 - q) / n)
    assert abs(dropped.float().mean().item() - q) < 5 * sigma
    # the four lanes of a word and neighbouring words decide independently
    pairs = dropped[:-1] & dropped[1:]
    assert abs(pairs.float().mean().item() - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / n)
    lanes = dropped.view(-1, 4).float().mean(0)
    assert torch.all((lanes - q).abs() < 5 * math.sqrt(q * (1 - q) / (n // 4)))


def test_the_drop_probability_is_rounded_to_1_over_65536():
    assert quantized_p(0.1) == 6554 / 65536
    assert quantized_p(0.5) == 0.5
    # p below half a level drops nothing; above 1 - half a level drops everything
    torch.manual_seed(0)
    assert bulk_keep_mask((4096,), 1e-6).all()
    assert not bulk_keep_mask((4096,), 1 - 1e-6).any()


def test_masks_follow_torchs_generator():
    torch.manual_seed(3)
    a = bulk_keep_mask((7, 9), 0.3)
    b = bulk_keep_mask((7, 9), 0.3)
    torch.manual_seed(3)
    assert torch.equal(bulk_keep_mask((7, 9), 0.3), a)
    assert not torch.equal(a, b)  # the generator moved on


def test_bulk_dropout_scales_like_torch():
    x = torch.randn(1000)
    torch.manual_seed(0)
    out, keep = bulk_dropout(x, 0.25)
    torch.testing.assert_close(out, torch.where(keep, x / 0.75, torch.zeros_like(x)))
    same, keep_all = bulk_dropout(x, 0.25, train=False)
    assert torch.equal(same, x) and keep_all.all()
    zero, none = bulk_dropout(x, 1.0)
    assert not zero.any() and not none.any()


def test_eager_dropout_draws_bulk_masks_in_the_context():
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    keep = bulk_keep_mask(x.shape, 0.2)
    torch.manual_seed(5)
    with bulk_dropout_masks():
        functional = F.dropout(x, 0.2, training=True)
    torch.testing.assert_close(functional, torch.where(keep, x / 0.8, torch.zeros_like(x)))
    torch.manual_seed(5)
    with bulk_dropout_masks():
        module = nn.Dropout(0.2).train()(x)
    torch.testing.assert_close(module, functional)


class AttentionBlock(nn.Module):
    """Linear -> SDPA with attention dropout -> dropout -> linear: every dropout lowering."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        h = F.dropout(att.transpose(1, 2).flatten(2), 0.3, training=self.training)
        return self.out(self.drop(h)).square().mean()


def _step(model: nn.Module, x: torch.Tensor, context=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    with context if context is not None else contextlib.nullcontext():
        loss = model(x)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_steps_close(a, b) -> None:
    torch.testing.assert_close(a[0], b[0])
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_compiled_bulk_region_equals_its_eager_code_with_bulk_masks():
    torch.manual_seed(0)
    ref = AttentionBlock().train()
    x = torch.randn(4, 10, 16)
    eager_masks = _step(ref, x)
    bulk_masks = _step(ref, x, bulk_dropout_masks())
    # a region compiled with the default rng first, then a copy with rng="bulk": inductor's
    # caches must not hand the first one's graph to the second (or the reverse)
    for rng, expected in (("eager", eager_masks), ("bulk", bulk_masks), ("eager", eager_masks)):
        test = AttentionBlock().train()
        test.load_state_dict(ref.state_dict())
        sch = slapo.create_schedule(test)
        sch.compile(rng=rng)
        model, _ = slapo.build(sch, init_weights=False)
        for _ in range(2):  # the compiled code is reused
            _assert_steps_close(_step(model, x), expected)
    assert not torch.equal(eager_masks[0], bulk_masks[0])  # the two really differ


def test_bad_rng_requests_are_clear_errors():
    sch = slapo.create_schedule(AttentionBlock())
    with pytest.raises(PrimitiveError, match="rng must be one of"):
        sch.compile(rng="fast")
    with pytest.raises(PrimitiveError, match="rng= are inductor settings"):
        sch.compile(backend="aot_eager", rng="bulk")
    with pytest.raises(slapo.SlapoError, match="compile_rng must be one of"):
        slapo.model_schedule.Knobs(compile_rng="fast")


@pytest.mark.slow
def test_a_dropout_the_checkpoint_recomputes_redraws_the_same_bulk_mask():
    # A selective policy that recomputes dropout: inductor saves the generator state before the
    # bulk draw and replays it in backward, so forward and recompute use one mask.
    from slapo.random import recompute_dropout

    torch.manual_seed(0)
    ref = AttentionBlock().train()
    x = torch.randn(4, 10, 16)
    test = AttentionBlock().train()
    test.load_state_dict(ref.state_dict())
    sch = slapo.create_schedule(test)
    sch.checkpoint(policy=recompute_dropout("save_matmuls"))
    sch.compile(rng="bulk")
    model, _ = slapo.build(sch, init_weights=False)
    _assert_steps_close(_step(model, x), _step(ref, x, bulk_dropout_masks()))
