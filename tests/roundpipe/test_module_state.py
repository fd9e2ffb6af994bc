"""Device copies follow the host module's non-tensor state (train/eval, attributes) every step."""

from __future__ import annotations

import copy

import torch
from torch import nn

from roundpipe import RoundPipe


def test_eval_after_training_turns_dropout_off_on_every_device(ndev):
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)
    )
    model = RoundPipe(copy.deepcopy(ref), pin_model="off")
    x = torch.randn(6, 8)
    model.train()
    with torch.no_grad():
        model(x)  # device copies of every layer now exist, made in train mode
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
        torch.testing.assert_close(model(x), ref(x))
