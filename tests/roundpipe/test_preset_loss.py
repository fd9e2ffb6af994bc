"""The presets' loss: chunked fused head + cross-entropy, ``return_logits``,
``num_items_in_batch`` and microbatches, against the plain transformers model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.models import loss as loss_mod
from roundpipe.models.causal_lm import target_count
from roundpipe.models.loss import linear_cross_entropy_sum

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen3() -> nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


MAKERS = {"llama": _llama, "qwen3": _qwen3, "gpt2": _gpt2}


def _pair(name: str, n_mb: int = 2) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(reference model, the wrapped twin's transformers model, the RoundPipe preset)."""
    torch.manual_seed(0)
    ref = MAKERS[name]()
    hf = copy.deepcopy(ref)
    cfg = RoundPipeRunConfig(num_microbatch=n_mb)
    rp = wrap_model_to_roundpipe(
        hf, use_sequential_preset=True, model_run_config=cfg, pin_model="off"
    )
    return ref, hf, rp


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels whose microbatches hold different numbers of targets."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8))
    labels = ids.clone()
    labels[0, 2:] = -100  # microbatch 0: 1 + 7 targets, microbatch 1: 7 + 7
    return ids, labels


def _assert_grads(hf: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("num_items", [None, 11], ids=["mean", "num_items"])
def test_loss_and_grads_match_transformers(two_devices, name, num_items):
    ref, hf, rp = _pair(name)
    ids, labels = _batch()
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = ref(input_ids=ids, labels=labels, **kw)
    want.loss.backward()
    for return_logits in (True, False):
        hf.zero_grad()
        out = rp(input_ids=ids, labels=labels, return_logits=return_logits, **kw)
        torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
        if return_logits:
            torch.testing.assert_close(out.logits, want.logits.detach(), rtol=1e-5, atol=1e-6)
        else:
            assert out.logits is None
        out.loss.backward()
        _assert_grads(hf, ref)


@pytest.mark.parametrize("num_items", [None, 11], ids=["mean", "num_items"])
def test_forward_backward_sums_to_full_batch(two_devices, num_items):
    """The microbatch losses add up to the full-batch loss: no division by the count."""
    ref, hf, rp = _pair("llama", n_mb=3)
    ids, labels = _batch()
    ids, labels = ids[:3], labels[:3]  # 3 microbatches of one row each: 1, 7, 7 targets
    kw = {} if num_items is None else {"num_items_in_batch": num_items}  # an int works too
    want = ref(input_ids=ids, labels=labels, **kw)
    want.loss.backward()
    got, out = rp.forward_backward(
        input_kwargs={"input_ids": ids, "labels": labels, "return_logits": False, **kw},
        return_outputs=True,
    )
    torch.testing.assert_close(got, want.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, got)  # the merged output sums the microbatches too
    _assert_grads(hf, ref)


def test_issue_example_num_items_honoured(two_devices):
    """A loss normalised over a gradient-accumulation window (issue 27's 4.8466 vs 0.2908)."""
    ref, _, rp = _pair("qwen3")
    ids, labels = _batch()
    n = torch.tensor(16 * target_count({"labels": labels}).item())
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        got = rp(input_ids=ids, labels=labels, num_items_in_batch=n, return_logits=False).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_head_never_sees_more_than_a_chunk(two_devices, monkeypatch):
    ref, hf, rp = _pair("llama")
    rows: list[int] = []
    real = loss_mod._chunk_logits

    def spy(x, weight, bias):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(loss_mod, "_chunk_logits", spy)
    for layer in rp.layers:  # the head layer
        if hasattr(layer, "chunk_size"):
            layer.chunk_size = 5
    ids, labels = _batch()
    out = rp(input_ids=ids, labels=labels, return_logits=False)
    out.loss.backward()
    assert rows and max(rows) <= 5  # each microbatch has 14 or 16 tokens
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads(hf, ref)


@pytest.mark.parametrize("wrap", [lambda h: h, nn.Sequential], ids=["linear", "other-head"])
def test_chunked_cross_entropy_matches_plain(wrap):
    """The fused kernel (a plain Linear) and the checkpointed path (any other head)."""
    torch.manual_seed(0)
    head = wrap(nn.Linear(8, 16))
    twin = copy.deepcopy(head)
    x = torch.randn(3, 5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    t = torch.randint(0, 16, (15,))
    t[[0, 7]] = -100
    got = linear_cross_entropy_sum(x, head, t, chunk_size=4) * 0.5
    want = nn.functional.cross_entropy(twin(x2).reshape(15, 16), t, reduction="sum") * 0.5
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, x2.grad)
    for p, q in zip(head.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("name", ["loss", "causal_lm", "moe", "qwen3_moe"])
def test_docstring_examples(two_devices, name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"roundpipe.models.{name}"))
    assert result.attempted > 0 and result.failed == 0
