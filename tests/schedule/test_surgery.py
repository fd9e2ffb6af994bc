"""The floor module: its docstring examples run, and each helper does its one job."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from slapo import surgery


def test_docstring_examples():
    result = doctest.testmod(surgery, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_wrapping_keeps_names_and_hooks_and_stacks():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = lin(x)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    surgery.wrap_forward(lin, "double", lambda fwd, *a: 2 * fwd(*a))
    surgery.wrap_forward(lin, "plus1", lambda fwd, *a: fwd(*a) + 1)
    assert surgery.forward_wraps(lin) == ("double", "plus1")
    assert isinstance(lin, nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(lin(x), 2 * ref + 1, rtol=0, atol=0)  # the same ops, exactly
    assert seen == [torch.Size([2, 3])]


def test_unique_name_skips_taken_names():
    owner = nn.Module()
    assert surgery.unique_name(owner, "a.b") == "a_b"
    owner.a_b = nn.ReLU()
    owner.a_b_0 = nn.ReLU()
    assert surgery.unique_name(owner, "a.b") == "a_b_1"


def test_set_submodule_rejects_a_missing_owner():
    model = nn.Sequential(nn.ReLU())
    with pytest.raises(AttributeError):
        surgery.set_submodule(model, "3.x", nn.GELU())
