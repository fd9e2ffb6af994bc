"""Tensor-parallel plans on 2 gloo ranks: each model's loss and every gradient against one
process (a sharded parameter's gradient against its slice), as plain data plans give them."""

from __future__ import annotations

import copy
from typing import Any

import torch

import slapo
from slapo.exceptions import SlapoError
from slapo.model_schedule import TPPlan, apply_schedule, apply_tp_plan
from slapo.sharding import get_shard_spec
from slapo.testing import zoo_models

#: case -> (model type, knobs, where its plan comes from)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "phi3": ("phi3", {}, "hf: fused qkv and gate_up, split and gathered"),
    "olmo2": ("olmo2", {}, "hf: q/k norms over all heads, so gathered"),
    "mixtral": ("mixtral", {}, "hf: experts split, router whole"),
    "llama4_text": ("llama4_text", {}, "hf: experts stored [in, out]; the prefix it lacks"),
    "hy_v4": ("hy_v4", {}, "hf: attention sinks split, latent K/V projection whole"),
    "starcoder2": ("starcoder2", {}, "hf: biased projections"),
    "falcon": ("falcon", {}, "inferred: fused query_key_value"),
    "moshi": ("moshi", {}, "inferred: fc1 packs gate and up, so gathered"),
    "electra": ("electra", {}, "inferred: BERT's layout"),
    "llama+sp": ("llama", {"sequence_parallel": True}, "sequence parallel"),
    "qwen3+sp": ("qwen3", {"sequence_parallel": True}, "sequence parallel, per-head norms"),
    "olmo2+sp": ("olmo2", {"sequence_parallel": True}, "sequence parallel around gathers"),
    "phi3+sp": ("phi3", {"sequence_parallel": True}, "sequence parallel, fused gathers"),
}


def _relative_worst(model: torch.nn.Module, grads: dict, ref_grads: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, param in model.named_parameters():
        key = zoo_models._clean_name(name)
        if grads[key] is None or ref_grads[key] is None:  # unused by this loss: both, or wrong
            if (grads[key] is None) != (ref_grads[key] is None):
                return float("inf"), key
            continue
        spec = get_shard_spec(param)
        want = ref_grads[key] if spec is None else spec.local_slice(ref_grads[key])
        diff = (grads[key] - want).abs().max().item() / max(want.abs().max().item(), 1e-3)
        if diff > worst:
            worst, where = diff, key
    return worst, where


def plans_job(rank: int, world: int) -> dict[str, Any]:
    """Per case: (reference loss, loss, worst relative gradient difference, its parameter,
    sharded parameter count)."""
    out: dict[str, Any] = {}
    known = set(zoo_models.causal_lm_types())
    for case, (model_type, knobs, _) in CASES.items():
        if model_type not in known:  # newer than the installed transformers
            out[case] = None
            continue
        torch.manual_seed(0)
        ref = zoo_models.tiny_model(model_type)
        model = copy.deepcopy(ref)
        batch = zoo_models.sample_batch(ref)
        ref_loss, ref_grads = zoo_models.train_step(ref, batch)
        try:
            sch = apply_schedule(
                model, group=torch.distributed.group.WORLD, ckpt_ratio=0.0, **knobs
            )
        except SlapoError as exc:  # judged by the test (an older transformers' plan)
            out[case] = str(exc)
            continue
        model, _ = slapo.build(sch, init_weights=False)
        loss, grads = zoo_models.train_step(model, batch)
        worst, where = _relative_worst(model, grads, ref_grads)
        sharded = sum(get_shard_spec(p) is not None for p in model.parameters())
        out[case] = (float(ref_loss), float(loss), worst, where, sharded)
    out["errors"] = _errors()
    return out


def _errors() -> dict[str, str | None]:
    """The typed errors of plans that cannot be right."""
    group = torch.distributed.group.WORLD
    errors: dict[str, str | None] = {}
    cases = {
        "heads": lambda: _odd_heads(group),
        "no row": lambda: apply_tp_plan(
            slapo.create_schedule(zoo_models.tiny_model("llama"), group=group),
            TPPlan({"model.layers.*.mlp.up_proj": "colwise"}),
        ),
        "packed halves": lambda: apply_schedule(
            zoo_models.tiny_model("inkling2_text"), group=group, ckpt_ratio=0.0
        ),
        "sequence parallel experts": lambda: apply_schedule(
            zoo_models.tiny_model("mixtral"), group=group, ckpt_ratio=0.0, sequence_parallel=True
        ),
    }
    known = set(zoo_models.causal_lm_types())
    for name, make in cases.items():
        if name == "packed halves" and "inkling2_text" not in known:
            errors[name] = None
            continue
        try:
            make()
            errors[name] = "no error"
        except SlapoError as exc:
            errors[name] = str(exc)
    return errors


def _odd_heads(group: Any) -> None:
    config = zoo_models.tiny_config("llama")
    config.num_attention_heads = config.num_key_value_heads = 3
    config.head_dim = 16
    model = type(zoo_models.tiny_model("llama"))(config)
    apply_schedule(model, group=group, ckpt_ratio=0.0)
