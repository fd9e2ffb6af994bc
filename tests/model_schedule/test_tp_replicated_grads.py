"""Under every ready tensor-parallel schedule (2 gloo ranks), each parameter's gradient matches one
process: the whole gradient for a replicated parameter, the slice for a sharded one (issue 24:
Qwen3's per-head q_norm/k_norm kept each rank's partial gradient, silently). The mechanism,
``sync(mode="bwd_param")``, is checked on its own in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from tp_grad_jobs import CHECKS, MODELS, grads_job

import slapo
from dist_utils import check_all, run_workers
from slapo.model_schedule.helpers import per_head_norms


@pytest.fixture(scope="module")
def reports():
    return check_all(run_workers(grads_job, 2, deadline=150.0))


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_tp_gradients_of_replicated_and_sharded_parameters(reports, check):
    errors = [f"rank {r}:\n{rep[check]}" for r, (rep, _) in enumerate(reports) if rep[check]]
    assert not errors, "\n".join(errors)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_qwen3_per_head_norms_stay_replicated_and_are_checked(reports):
    # The check above must have seen the norms as replicated parameters, not as sharded ones.
    for _, diffs in reports:
        for check in ("qwen3", "qwen3 + ckpt + sdpa"):
            norms = {f"model.layers.*.self_attn.{n}.weight" for n in ("q_norm", "k_norm")}
            assert norms <= set(diffs[check]), (check, sorted(diffs[check]))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _grads(model: nn.Module, steps: int = 2) -> dict[str, torch.Tensor]:
    """Gradients accumulated over ``steps`` batches, each using the norm twice."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=gen)
        hidden = model[1](model[0](x))
        (model[2](model[1](hidden)) ** 2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_sync_bwd_param_runs_the_op_once_per_backward_before_accumulation():
    torch.manual_seed(0)
    ref = _mlp()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    sch["1"].sync(mode="bwd_param", sync_op_or_fn=lambda g, k: g * k, k=3.0)
    want, got = _grads(ref), _grads(model)
    for name, grad in want.items():
        # Only the norm's own parameters; each step's gradient tripled, not the running sum.
        scale = 3.0 if name.startswith("1.") else 1.0
        torch.testing.assert_close(got[name], scale * grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(60)
def test_sync_bwd_param_follows_parameters_materialized_from_meta():
    with slapo.init_empty_weights():
        model = _mlp()
    sch = slapo.create_schedule(model)
    sch["1"].sync(mode="bwd_param", sync_op_or_fn=lambda g: g * 2.0)
    model, _ = slapo.build(sch)  # new parameter objects replace the meta ones
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    want, got = _grads(ref, steps=1), _grads(model, steps=1)
    for name, grad in want.items():
        scale = 2.0 if name.startswith("1.") else 1.0
        torch.testing.assert_close(got[name], scale * grad, msg=lambda m, n=name: f"{n}: {m}")


def test_sync_bwd_param_on_a_module_without_parameters_names_it():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(slapo.PrimitiveError, match=r'"1" \(ReLU\): the module has no replicated'):
        sch["1"].sync(mode="bwd_param", sync_op_or_fn=lambda g: g)


def test_per_head_norms_finds_qwen3_q_k_norms_and_refuses_a_norm_across_heads():
    model = MODELS["qwen3"]()
    sch = slapo.create_schedule(model)
    attn = "model.layers.0.self_attn"
    assert per_head_norms(sch, attn) == [f"{attn}.q_norm", f"{attn}.k_norm"]
    assert per_head_norms(slapo.create_schedule(MODELS["llama"]()), attn) == []
    model.model.layers[0].self_attn.q_norm = nn.RMSNorm(32)  # over all heads (as OLMo2's)
    with pytest.raises(slapo.SlapoError, match='"q_norm" has 32 weights, not head_dim = 8'):
        per_head_norms(slapo.create_schedule(model), attn)
