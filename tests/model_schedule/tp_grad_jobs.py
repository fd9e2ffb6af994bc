"""The gradient of every parameter under a ready tensor-parallel schedule, per family, run in
spawned gloo workers: a replicated parameter's gradient is the whole single-process one, a sharded
parameter's gradient its slice of it.

A replicated parameter that consumes sharded activations (Qwen3's per-head ``q_norm``/``k_norm``
sees only this rank's heads) gets a partial gradient on each rank unless the plan sums it over the
group; nothing else would notice, the loss being right.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import transformers
from torch import nn

import hf_models
import slapo
from dist_utils import run_checks
from slapo.model_schedule import apply_schedule
from slapo.sharding import get_shard_spec

# Llama's layout, as each family's config spells it; head_dim 8 (32 / 4 heads).
_LLAMA_LAYOUT = {
    "vocab_size": hf_models.VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "use_cache": False,
}  # fmt: skip


def _llama_like(config_cls: type, model_cls: type, **extra: object) -> Callable[[], nn.Module]:
    return lambda: model_cls(config_cls(**_LLAMA_LAYOUT, **extra))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: hf_models.llama(dropout=0.0),
    "mistral": _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM, head_dim=8),
    "qwen2": _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # biased q/k/v
    "qwen3": _llama_like(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=8),
    "gpt2": lambda: hf_models.gpt2(dropout=0.0),
    "bert": lambda: hf_models.bert(dropout=0.0),
    "opt": lambda: hf_models.opt(dropout=0.0),
    "t5": lambda: hf_models.t5(dropout=0.0),
}


# Each family's plan alone, and Qwen3's per-head norms under checkpoint recompute as well.
CHECKS: dict[str, tuple[str, dict[str, object]]] = {
    **{family: (family, {}) for family in MODELS},
    "qwen3 + ckpt + sdpa": ("qwen3", {"ckpt_ratio": 1.0, "attn_op": "sdpa"}),
}


def family_grads(family: str, diffs: dict[str, float], **knobs: object) -> None:
    """Schedule ``family`` with ``group=`` and ``knobs``; assert every gradient against one
    process.

    Fills ``diffs`` (before asserting) with the largest gradient difference per replicated
    parameter kind: the name without its block index, e.g.
    ``model.layers.*.self_attn.q_norm.weight``.
    """
    torch.manual_seed(0)
    ref = MODELS[family]().train()
    model = copy.deepcopy(ref)
    sch = apply_schedule(model, group=torch.distributed.group.WORLD, **knobs)
    model, _ = slapo.build(sch, init_weights=False)
    data = hf_models.batch()
    ref_loss, ref_grads = hf_models.run(ref, data)
    loss, grads = hf_models.run(model, data)
    torch.testing.assert_close(loss, ref_loss)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    failures = []
    for name, param in model.named_parameters():
        spec = get_shard_spec(param)
        want = ref_grads[name] if spec is None else spec.local_slice(ref_grads[name])
        if spec is None:
            kind = ".".join("*" if part.isdigit() else part for part in name.split("."))
            diff = (grads[name] - want).abs().max().item()
            diffs[kind] = max(diffs.get(kind, 0.0), diff)
        try:
            torch.testing.assert_close(grads[name], want)  # float32 defaults
        except AssertionError as err:
            failures.append(f"{'replicated' if spec is None else 'sharded'} {name}: {err}")
    assert not failures, f"{family}: wrong gradients under tensor parallelism:\n" + "\n".join(
        failures
    )
    assert any(get_shard_spec(p) is not None for p in model.parameters()), "nothing sharded"


def grads_job(rank: int, world: int) -> tuple[dict[str, str | None], dict[str, dict[str, float]]]:
    """Every check of :data:`CHECKS` (``run_checks``) and the gradient differences it measured."""
    torch.set_num_threads(1)
    diffs: dict[str, dict[str, float]] = {name: {} for name in CHECKS}
    report = run_checks(
        {
            name: (lambda name=name, fam=fam, kw=kw: family_grads(fam, diffs[name], **kw))
            for name, (fam, kw) in CHECKS.items()
        }
    )
    return report, diffs
