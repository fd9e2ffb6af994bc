"""The generic preset: Llama-style transformers causal LMs without a preset of their own, dense
and mixture-of-experts, against plain PyTorch (loss, router loss, every gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.models import generic_preset, moe, routing

zoo = pytest.importorskip("slapo.testing")


def _batch(model: nn.Module) -> dict[str, torch.Tensor]:
    batch = zoo.sample_batch(model, batch=4, seq=12, seed=3)
    batch["labels"][0, 7:] = -100
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][3, 9:] = 0
    return batch


def _run_both(model_type: str, grain: str, **call: object) -> tuple:
    ref = zoo.tiny_model(model_type)
    hf = copy.deepcopy(ref)
    rp = wrap_model_to_roundpipe(
        hf,
        use_sequential_preset=True,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain),
    )
    batch = _batch(ref)
    want = ref(**batch, **call)
    want.loss.backward()
    got = rp(**batch, **call)
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    return rp, got, want


def test_dense_type_without_a_preset_equals_pytorch(two_devices):
    rp, _, _ = _run_both("mistral", "stage")
    assert rp.num_layers == 2 + zoo.tiny_config("mistral").num_hidden_layers


def test_mixtral_router_loss_and_replayed_routing_equal_pytorch(two_devices, monkeypatch):
    monkeypatch.setattr(moe, "_FOUND_RULES", {})
    _, got, want = _run_both("mixtral", "layer", output_router_logits=True)
    torch.testing.assert_close(got.aux_loss, want.aux_loss.detach(), rtol=1e-5, atol=1e-6)
    # the rule that recomputes Mixtral's scores at the saved experts was found in forward
    assert moe._FOUND_RULES["MixtralTopKRouter"] in routing.SCORE_RULES


def test_moe_without_router_loss_adds_none(two_devices):
    # GLM-4-MoE's forward adds no load-balancing loss: output_router_logits must not add one
    _, got, want = _run_both("glm4_moe", "stage", output_router_logits=True)
    assert getattr(got, "aux_loss", None) is None


def test_type_the_generic_preset_does_not_reproduce_is_refused_by_name(two_devices):
    model = zoo.tiny_model("cohere")  # scales its logits: not the plain Llama head
    assert (
        generic_preset.is_llama_style(model) and "cohere" not in generic_preset.GENERIC_MODEL_TYPES
    )
    with pytest.raises(NotImplementedError, match="'cohere'"):
        wrap_model_to_roundpipe(model, use_sequential_preset=True, pin_model="off")


class OddRouter(nn.Module):
    """A top-k router whose scores follow no known rule and whose choice flips per call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> tuple:
        self.calls += 1
        logits = x * 1.0
        idx = torch.full((x.shape[0], 1), self.calls % 2, dtype=torch.long)
        return logits, logits.gather(-1, idx) * 3 + 1, idx


def test_recompute_choosing_other_experts_without_a_rule_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(moe, "_FOUND_RULES", {})
    router = OddRouter()
    assert moe.install_router_hooks(router) == 1
    x = torch.randn(3, 2)
    with moe._routing_session(None) as forward:
        router(x)
    assert moe._FOUND_RULES["OddRouter"] is None
    with moe._routing_session(tuple(forward.indices)):
        with pytest.raises(routing.RoutingReplayError, match="OddRouter"):
            router(x)
    router.calls = 0  # the same choice again: the recompute runs as it is
    with moe._routing_session(tuple(forward.indices)) as replay:
        router(x)
    assert torch.equal(replay.indices[0], forward.indices[0])


@pytest.mark.parametrize("name", ["generic_preset", "routing"])
def test_generic_docstring_examples(two_devices, name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"roundpipe.models.{name}"))
    assert result.attempted > 0 and result.failed == 0
