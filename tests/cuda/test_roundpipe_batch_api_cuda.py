"""Seed 004's batch API on the GPU: a model returning unmerged outputs hands packed microbatches
whose transfer events are real CUDA events to a second model, which waits on them (no host
sync) and trains like plain PyTorch."""

from __future__ import annotations

import copy

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipePackedData, RoundPipeRunConfig


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        return h, h.sum(dim=1, keepdim=True)


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 1)

    def forward(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + s


def _rp(module: nn.Module, **cfg: object) -> RoundPipe:
    return RoundPipe(
        nn.Sequential(module), pin_model="alloc", model_run_config=RoundPipeRunConfig(**cfg)
    )


def test_chained_models_pass_packed_data_with_cuda_events(gpu):
    torch.manual_seed(0)
    ref_a, ref_b = TwoOut(), Join()
    a = _rp(copy.deepcopy(ref_a), num_microbatch=2, merge_output=False)
    b = _rp(copy.deepcopy(ref_b), num_microbatch=2)
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    packed = a(x)
    assert all(isinstance(p, RoundPipePackedData) and len(p) == 2 for p in packed)
    for fwd_event, _ in packed[0].transfer_event:
        assert isinstance(fwd_event, torch.cuda.Event)
    loss = b.forward_backward(
        packed, label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / 2
    )
    a.synchronize()
    b.synchronize()
    ref_h, ref_s = ref_a(x)
    ref_loss = nn.functional.mse_loss(ref_b(ref_h, ref_s), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
    params = [*a.model.parameters(), *b.model.parameters()]
    for p, q in zip(params, [*ref_a.parameters(), *ref_b.parameters()]):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-5)
