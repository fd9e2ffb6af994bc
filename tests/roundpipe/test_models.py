"""Presets for Hugging Face models (random weights from small configs) and the heuristic."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, tiny_qwen3
from torch import nn

import roundpipe
from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def _tiny_qwen3():
    return tiny_qwen3()


def _tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _ce(n_mb):
    def loss_fn(out, labels):
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        return nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1)) / n_mb

    return loss_fn


@pytest.mark.slow
def test_llama_preset_sync_training_equals_pytorch(ndev):
    ref = _tiny_llama()
    hf = copy.deepcopy(ref)
    model = wrap_model_to_roundpipe(
        hf, model_run_config=RoundPipeRunConfig(num_microbatch=2), pin_model="off"
    )
    assert isinstance(model, RoundPipe) and model.num_layers == 5
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    torch.manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 64, (4, 8))
        ref_out = ref(input_ids=ids, labels=ids)
        ref_out.loss.backward()
        loss = model.forward_backward(input_kwargs={"input_ids": ids}, label=ids, loss_fn=_ce(2))
        assert_close(loss, ref_out.loss.detach(), f"llama loss at step {step}")
        for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(hf.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_llama_preset_autograd_forward_matches(two_devices):
    ref = _tiny_llama()
    hf = copy.deepcopy(ref)
    model = wrap_model_to_roundpipe(
        hf, model_run_config=RoundPipeRunConfig(num_microbatch=2), pin_model="off"
    )
    ids = torch.randint(0, 64, (4, 8))
    out = model(input_ids=ids, labels=ids)
    ref_out = ref(input_ids=ids, labels=ids)
    assert_close(out.logits, ref_out.logits.detach(), "llama logits")
    out.loss.backward()
    ref_out.loss.backward()
    for p, q in zip(hf.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert model.config.model_type == "llama"  # attribute shim to the HF model


@pytest.mark.parametrize("make", [_tiny_qwen3, _tiny_gpt2], ids=["qwen3", "gpt2"])
def test_other_presets_match(two_devices, make):
    ref = make()
    hf = copy.deepcopy(ref)
    model = wrap_model_to_roundpipe(
        hf,
        use_sequential_preset=True,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    ids = torch.randint(0, 64, (4, 8))
    out = model(input_ids=ids, labels=ids)
    ref_out = ref(input_ids=ids, labels=ids)
    assert_close(out.loss, ref_out.loss.detach(), "preset loss")
    out.loss.backward()
    ref_out.loss.backward()
    for p, q in zip(hf.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_preset_required_but_missing_raises(two_devices):
    with pytest.raises(NotImplementedError, match="preset"):
        wrap_model_to_roundpipe(nn.Linear(2, 2), use_sequential_preset=True)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_heuristic_auto_roundpipe_trains_like_pytorch(ndev):
    torch.manual_seed(0)
    ref = _Net()
    net = copy.deepcopy(ref)
    model = wrap_model_to_roundpipe(
        net,
        lower_threshold=1024,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    assert isinstance(model, AutoRoundPipe)
    assert all(isinstance(b, RoundPipe) for b in net.blocks)
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        assert_close(loss.detach(), ref_loss.detach(), "auto loss")
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(nn.Module.parameters(net), ref.parameters()):
        assert_close(p, q, "auto params")


def test_grad_scaler_matches_torch(two_devices):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    net = copy.deepcopy(ref)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = roundpipe.GradScaler(init_scale=2.0**4, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    for i in range(5):
        x, y = torch.randn(4, 4), torch.randn(4, 1)
        if i == 2:
            x[0, 0] = float("inf")  # overflow: the step is skipped and the scale backs off
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update()
        ref_scaler.scale(nn.functional.mse_loss(ref(x), y)).backward()
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        model.synchronize()
        # up_to_date: the update's result (plain get_scale() still reports this step's scale)
        assert scaler.get_scale(up_to_date=True) == ref_scaler.get_scale(), f"scale at step {i}"
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q, "params with grad scaling")
