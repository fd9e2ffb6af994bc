"""The long-context configuration of the presets: SDPA attention, ``recompute_grain="layer"``
over multi-layer stages, ``return_logits=False`` (chunked head + loss), against the plain
transformers model with eager attention."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe.models as models
from roundpipe import ModelExecutePlan, RoundPipeRunConfig, device, wrap_model_to_roundpipe
from roundpipe.models.kernels import prefer_sdpa

transformers = pytest.importorskip("transformers")

VOCAB = 96
N_BLOCKS = 4


def _llama(attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=N_BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)


def _plan() -> ModelExecutePlan:
    """Embedding + 2 blocks | 2 blocks | head (the fused stage): multi-layer stages."""
    n = N_BLOCKS + 2
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3), range(3, n - 1), range(n - 1, n)]
    plan.bwd_plan = [range(n - 1, n), range(3, n - 1), range(0, 3)]
    plan.check_valid(n, "fused")
    return plan


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("grain", ["layer", "stage"])
def test_long_context_preset_equals_eager_pytorch(two_devices, grain):
    ref = _llama("eager")
    hf = copy.deepcopy(ref)
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=_plan())
    rp = wrap_model_to_roundpipe(hf, pin_model="off", model_run_config=cfg)
    assert hf.config._attn_implementation == "sdpa"  # switched by the preset
    assert ref.config._attn_implementation == "eager"
    batch = _batch()
    want = ref(**batch)
    want.loss.backward()
    loss = rp.forward_backward(input_kwargs={**batch, "return_logits": False})
    torch.testing.assert_close(loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    hf.zero_grad()  # the autograd entry point: every stage but the head recomputes
    out = rp(**batch, return_logits=False)
    assert out.logits is None
    out.loss.backward()
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_layer_grain_peak_below_stage_grain_on_preset(two_devices, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_ACCOUNT_ACTIVATIONS", "1")
    peaks = {}
    for grain in ("stage", "layer"):
        cfg = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain, execute_plan=_plan())
        rp = wrap_model_to_roundpipe(_llama("sdpa"), pin_model="off", model_run_config=cfg)
        for d in device.get_devices():
            d.memory.reset_peak()
        ids = torch.randint(0, VOCAB, (1, 256))
        rp.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False})
        device.wait_devices_idle(timeout=30)
        peaks[grain] = max(d.memory.peak for d in device.get_devices())
    assert peaks["layer"] < peaks["stage"], peaks


def test_prefer_sdpa_keeps_other_choices(monkeypatch):
    assert prefer_sdpa(_llama("eager")) == "sdpa"
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB)
    )
    gpt2.set_attn_implementation("eager")
    assert prefer_sdpa(gpt2) == "sdpa"
    monkeypatch.setattr(models, "PREFER_SDPA", False)
    assert prefer_sdpa(_llama("eager")) == "eager"
