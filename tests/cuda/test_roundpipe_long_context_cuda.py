"""Long-context paths on a real GPU: ``recompute_grain="layer"`` (layer inputs kept on the host,
each layer recomputed once), SDPA and compiled preset blocks, against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe.models as models
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

transformers = pytest.importorskip("transformers")

VOCAB = 128


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(6)])


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_layer_grain_trains_like_pytorch_on_gpu(gpu, grain):
    ref = _net().cuda()
    net = _net()
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3), range(3, 6)]
    plan.bwd_plan = [range(3, 6), range(0, 3)]
    cfg = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, execute_plan=plan)
    model = RoundPipe(net, pin_model="alloc", model_run_config=cfg)
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    ref_loss = (ref(x.cuda()) ** 2).mean()
    ref_loss.backward()
    loss = model.forward_backward((x,), loss_fn=lambda out, _: (out**2).mean() / 4)
    torch.testing.assert_close(loss.cpu(), ref_loss.detach().cpu())
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), msg=lambda m, n=name: f"{n}: {m}")
    net.zero_grad()  # autograd entry point: every stage recomputes
    out = model(x)
    (out.cuda() ** 2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), msg=lambda m, n=name: f"{n}: {m}")


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_long_context_preset_on_gpu(gpu, monkeypatch, compile_layers):
    """SDPA (flash / memory-efficient kernels), layer grain, chunked loss; with and without
    compiled blocks (the default on CUDA), against the eager model on the GPU."""
    monkeypatch.setattr(models, "DISABLE_TORCH_COMPILE", not compile_layers)
    ref = _llama().cuda()
    hf = _llama()
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer")
    rp = wrap_model_to_roundpipe(hf, pin_model="alloc", model_run_config=cfg)
    assert hf.config._attn_implementation == "sdpa"
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 64))
    want = ref(input_ids=ids.cuda(), labels=ids.cuda())
    want.loss.backward()
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False}
    )
    torch.testing.assert_close(loss.cpu(), want.loss.detach().cpu(), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad.cpu(), rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
