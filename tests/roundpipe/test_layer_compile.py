"""Preset blocks compiled with ``torch.compile`` (opted in on a CPU virtual device) train like
the plain transformers model: loss and every gradient, recompute included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe.models as models
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.models import kernels

transformers = pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(scope="module")
def inductor_works() -> None:
    """Skip when inductor cannot build a CPU kernel here (no C++ compiler, ...)."""
    try:
        fn = torch.compile(lambda x: torch.tanh(x) * 2, options={"fallback_random": True})
        torch.testing.assert_close(fn(torch.ones(4)), torch.tanh(torch.ones(4)) * 2)
    except Exception as exc:  # noqa: BLE001 - any failure to compile means: cannot test here
        pytest.skip(f"torch.compile (inductor) does not work on this machine: {exc!r}")


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_compile_switches(monkeypatch):
    monkeypatch.setattr(models, "DISABLE_TORCH_COMPILE", None)
    monkeypatch.delenv(kernels.COMPILE_ENV, raising=False)
    assert kernels.compile_enabled(on_cuda=True)
    assert not kernels.compile_enabled(on_cuda=False)  # CPU virtual devices: opt-in
    monkeypatch.setenv(kernels.COMPILE_ENV, "1")
    assert kernels.compile_enabled(on_cuda=False)
    monkeypatch.setattr(models, "DISABLE_TORCH_COMPILE", True)
    assert not kernels.compile_enabled(on_cuda=True)
    monkeypatch.setattr(models, "DISABLE_TORCH_COMPILE", False)
    monkeypatch.setenv(kernels.COMPILE_ENV, "0")
    assert kernels.compile_enabled(on_cuda=False)


@pytest.mark.timeout(120)
def test_compiled_preset_equals_pytorch(two_devices, monkeypatch, inductor_works):
    monkeypatch.setattr(models, "DISABLE_TORCH_COMPILE", False)
    compiled_calls = []
    real = kernels._compiled_decoder_layer

    def spy():
        compiled_calls.append(1)
        return real()

    monkeypatch.setattr(kernels, "_compiled_decoder_layer", spy)
    ref = _llama()
    hf = copy.deepcopy(ref)
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer")
    rp = wrap_model_to_roundpipe(hf, pin_model="off", model_run_config=cfg)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12))
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    out = rp(input_ids=ids, labels=ids, return_logits=False)  # forward, then recompute
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want.loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # 2 blocks x 2 microbatches: no-grad forward and recompute both compiled
    assert len(compiled_calls) == 2 * 2 * 2
