"""Verify: passes on equivalent schedules, names the first primitive that breaks equivalence."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slapo
from hf_models import batch, make


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))


def test_equivalent_primitives_pass_in_train_mode_with_dropout():
    model = mlp()
    sch = slapo.create_schedule(model)
    x = torch.randn(5, 8)
    with slapo.Verify(sch, x, eval_mode=False):
        sch["1"].replace(nn.GELU())
        sch["0"].checkpoint()
        sch["3"].sync("fwd_post", lambda t: t)
    assert model[0].weight.grad is None  # the check leaves no gradients behind
    assert model.training


def test_a_wrong_replacement_is_named_with_its_path_arguments_and_difference():
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.verify.VerificationError) as info:
        with slapo.Verify(sch, torch.randn(5, 8)):
            sch["0"].checkpoint()
            sch["1"].replace(nn.ReLU())
            sch["3"].checkpoint()
    msg = str(info.value)
    assert 'replace(<ReLU>) on "1"' in msg and "max abs difference" in msg
    assert isinstance(info.value, AssertionError) and isinstance(info.value, slapo.SlapoError)


def test_a_wrong_gradient_hook_is_caught_through_gradients_only():
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.verify.VerificationError, match=r'sync\(.*\) on "3".*gradient'):
        with slapo.Verify(sch, torch.randn(5, 8)):
            sch["3"].sync("bwd_post", lambda g: g * 2)


def test_hugging_face_llama_with_keyword_inputs():
    model = make("llama")
    sch = slapo.create_schedule(model)
    data = batch()
    with slapo.Verify(sch, data, eval_mode=False, loss_fn=lambda out: out.loss):
        for i in range(2):
            sch[f"model.layers.{i}"].checkpoint()
        sch["model.layers.0.mlp"].replace(copy.deepcopy(model.model.layers[0].mlp))
    with pytest.raises(slapo.verify.VerificationError, match='"model.layers.1.mlp.act_fn"'):
        with slapo.Verify(sch, data, loss_fn=lambda out: out.loss):
            sch["model.layers.1.mlp.act_fn"].replace(nn.Tanh())


def test_errors_inside_the_block_propagate_and_disabled_verify_checks_nothing():
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.PrimitiveTypeError):
        with slapo.Verify(sch, torch.randn(2, 8)):
            sch["1"].replace("relu")
    with slapo.Verify(sch, torch.randn(2, 8), enable=False):
        sch["1"].replace(nn.ReLU())
    with pytest.raises(slapo.SlapoError, match="root schedule"):
        slapo.Verify(sch["0"], torch.randn(2, 8))


def test_a_replacement_that_breaks_a_shape_is_named_not_a_bare_runtime_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.GELU()))
    model.append(nn.Linear(16, 4))
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.verify.VerificationError) as info:
        with slapo.Verify(sch, torch.randn(5, 8)):
            sch["0"].checkpoint()
            sch["1.0"].replace(nn.Linear(16, 32))  # layer "2" still expects 16 features
            sch["1.1"].replace(nn.GELU())
    msg = str(info.value)
    assert "running it raises RuntimeError: mat1 and mat2 shapes cannot be multiplied" in msg
    assert 'The first primitive that breaks equivalence is replace(<Linear>) on "1.0"' in msg
    assert isinstance(info.value.__cause__, RuntimeError)  # the original error stays attached
    assert sch.mod[0].weight.grad is None


def test_example_inputs_the_original_model_rejects_are_a_slapo_error():
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.SlapoError, match="original model .* raises RuntimeError") as info:
        with slapo.Verify(sch, torch.randn(5, 7)):  # mlp() takes 8 features
            sch["0"].checkpoint()
    assert not isinstance(info.value, slapo.verify.VerificationError)
