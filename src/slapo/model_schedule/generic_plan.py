"""The generic plan: the schedule of any model whose type has no ready schedule.

Its blocks are the modules of the classes transformers keeps whole (``_no_split_modules``), or
else the children of the longest list of modules of one class. Tensor parallelism follows the
model's own ``config.base_model_tp_plan`` (:func:`~slapo.model_schedule.tp_plan.from_hf_plan`),
or else a plan inferred from the names of the projections in each block (:func:`infer_plan`);
the shared knobs (checkpointing, attention kernel, compilation, fused loss, pipeline cuts) apply
as for every family.

Example:
    >>> import transformers
    >>> from slapo.model_schedule import apply_schedule
    >>> config = transformers.Phi3Config(
    ...     num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ... )
    >>> phi3_model = transformers.Phi3ForCausalLM(config)
    >>> sch = apply_schedule(phi3_model)                 # the generic plan's recommended knobs
    >>> sch.extra["model_schedule"]["plan"]
    'generic'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from ..schedule import Schedule
from ..sharding.rules import is_norm
from ..surgery import is_conv1d
from .helpers import apply_shared_knobs, require, tp_size
from .knobs import Knobs
from .tp_plan import (
    PACKED_NAMES,
    AppliedPlan,
    TPPlan,
    apply_tp_plan,
    describe,
    from_hf_plan,
    is_linear,
)

__all__ = ["GENERIC_KNOBS", "find_blocks", "generic_plan", "infer_plan", "output_head"]

#: The generic plan's recommended knobs: half the blocks fully recomputed, nothing compiled (no
#: measurement backs more for an architecture the plan has never seen).
GENERIC_KNOBS: dict[str, Any] = {"ckpt_ratio": 0.5}

# Projection names by role: split by columns (the inputs of a region), split by rows (its
# output), or fused projections whose packing is the model's own (split, then gathered again).
_IN = {
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "gate_proj",
    "up_proj", "fc1", "fc_in", "c_fc", "w1", "w3", "wi", "wi_0", "wi_1", "dense_h_to_4h",
}  # fmt: skip
_OUT = {
    "o_proj", "out_proj", "dense", "c_proj", "wo", "down_proj", "fc2", "fc_out", "w2", "o",
    "dense_4h_to_h",
}  # fmt: skip
_FUSED = PACKED_NAMES
# Attributes an attention module keeps when it reshapes with global sizes (not ``-1`` heads).
_GLOBAL_SIZES = ("num_heads", "n_head", "num_attention_heads", "embed_dim", "all_head_size")


def find_blocks(model: nn.Module) -> tuple[list[str], str]:
    """The paths of ``model``'s repeated blocks, in order, and where they came from.

    Example:
        >>> import transformers
        >>> config = transformers.Phi3Config(
        ...     num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        ...     num_key_value_heads=2, vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ... )
        >>> phi3 = transformers.Phi3ForCausalLM(config)
        >>> find_blocks(phi3)
        (['model.layers.0', ..., 'model.layers.3'], 'Phi3DecoderLayer, from _no_split_modules')
    """
    keep_whole = set(getattr(model, "_no_split_modules", None) or ())
    paths: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(p + ".") for p in paths)
        if type(module).__name__ in keep_whole and path and not inside:
            paths.append(path)
    if paths:
        classes = sorted({type(model.get_submodule(p)).__name__ for p in paths})
        return paths, f"{', '.join(classes)}, from _no_split_modules"
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        kinds = {type(child) for child in module.children()}
        if isinstance(module, nn.ModuleList) and len(kinds) == 1 and len(module) > 1:
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    if best is None:
        return [], "no repeated blocks found"
    path, blocks = best
    return [f"{path}.{i}" for i in range(len(blocks))], (
        f"{type(blocks[0]).__name__}, the longest repeated list"
    )


def output_head(model: nn.Module) -> str | None:
    """The path of the model's LM head (its output embeddings), or None.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> llama = transformers.LlamaForCausalLM(config)
        >>> output_head(llama)
        'lm_head'
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    return next((p for p, m in model.named_modules() if m is head), None)


def infer_plan(sch: Schedule, blocks: list[str]) -> TPPlan:
    """A tensor-parallel plan from the projections in each block, by their names.

    In each module of a block holding projections: those named like inputs (``q_proj``,
    ``up_proj``, ``fc1``, ...) split by columns and the one named like an output (``o_proj``,
    ``down_proj``, ``fc2``, ...) by rows; an attention splits its heads only when it reshapes
    with ``-1`` heads, its heads divide, and its norms (if any) normalize one head; otherwise,
    and for fused projections (``qkv_proj``, ``gate_up_proj``), the inputs are split and gathered
    again (``colwise_gather``) and the output takes its slice (``rowwise_split``): the same
    numbers whatever the layout inside. A :class:`SlapoError` when no block has any.

    Example:
        >>> import slapo, transformers
        >>> config = transformers.GPTNeoConfig(
        ...     num_layers=1, attention_types=[[["global"], 1]], hidden_size=16, num_heads=2,
        ...     max_position_embeddings=16,
        ... )
        >>> env = slapo.env.setup(rank=0, world_size=1)  # a plan is inferred for a process group
        >>> sch = slapo.create_schedule(transformers.GPTNeoForCausalLM(config))
        >>> plan = infer_plan(sch, ["transformer.h.0"])
        >>> plan.styles["transformer.h.0.mlp.c_fc"], plan.styles["transformer.h.0.attn.attention.q_proj"]
        (Colwise(), ColwiseGather())
    """
    styles: dict[str, str] = {}
    divide: dict[str, tuple[str, ...]] = {}
    for blk in blocks:
        bert = _bert_layout(sch, blk)
        if bert is not None:
            styles.update(bert.styles)
            divide.update(bert.divide)
            continue
        for path, mod in sch[blk].mod.named_modules():
            full = f"{blk}.{path}" if path else blk
            styles.update(_group_styles(sch, full, mod))
    if not styles:
        raise SlapoError(
            f"tensor parallelism: {type(sch.mod).__name__} has no tensor-parallel plan of its own "
            f"(config.base_model_tp_plan) and slapo found no projections it can place in "
            f'"{blocks[0]}" (inputs named like {sorted(_IN)[:4]}..., an output like o_proj or '
            "down_proj); write a plan: slapo.model_schedule.TPPlan"
        )
    return TPPlan(styles, divide)


#: BERT's layout, which its many descendants keep (ELECTRA, ERNIE, RoFormer, RemBERT, ...): the
#: self attention's q/k/v and the output projection in two sibling modules, and the MLP's two
#: projections in two more.
_BERT_STYLES = {
    "attention.self.query": "colwise",
    "attention.self.key": "colwise",
    "attention.self.value": "colwise",
    "attention.output.dense": "rowwise",
    "intermediate.dense": "colwise",
    "output.dense": "rowwise",
}


def _bert_layout(sch: Schedule, block: str) -> TPPlan | None:
    """BERT's plan for ``block`` when it has BERT's layout (and nothing else to split in its
    self attention), else None."""
    mod = sch[block].mod
    names = dict(mod.named_modules())
    if not all(is_linear(names.get(rel, nn.Identity())) for rel in _BERT_STYLES):
        return None
    attn = names["attention.self"]
    if [n for n, c in attn.named_children() if is_linear(c)] != ["query", "key", "value"]:
        return None
    if any(_norm_width(m) is not None for m in attn.modules()):
        return None
    sizes = tuple(a for a in ("num_attention_heads", "all_head_size") if hasattr(attn, a))
    styles = {f"{block}.{rel}": style for rel, style in _BERT_STYLES.items()}
    return TPPlan(styles, {f"{block}.attention.self": sizes} if sizes else {})


def _group_styles(sch: Schedule, path: str, mod: nn.Module) -> dict[str, str]:
    linears = {n: c for n, c in mod.named_children() if is_linear(c)}
    ins = [n for n in linears if n in _IN]
    fused = [n for n in linears if n in _FUSED]
    outs = [n for n in linears if n in _OUT]
    if len(outs) != 1 or not (ins or fused) or len(ins) + len(fused) + 1 != len(linears):
        return {}
    gather = bool(fused) or not _splits_evenly(sch, path, mod, ins, outs[0])
    style_in, style_out = ("colwise_gather", "rowwise_split") if gather else ("colwise", "rowwise")
    styles = {f"{path}.{n}": style_in for n in (*ins, *fused)}
    styles[f"{path}.{outs[0]}"] = style_out
    return styles


def _splits_evenly(sch: Schedule, path: str, mod: nn.Module, ins: list[str], out: str) -> bool:
    """Whether the column split of ``mod``'s inputs keeps every rank's numbers its own: the
    inputs as wide as the output projection takes (no packed gate and up: Moshi's ``fc1``), whole
    heads per rank for an attention, no norm across the split features."""
    world = tp_size(sch)
    widths = [_width(getattr(mod, n), "out") for n in ins]
    row_in = _width(getattr(mod, out), "in")
    if any(w is None or w % world for w in widths) or row_in is None:
        return False
    attention = "att" in path.rsplit(".", 1)[-1].lower() or "Attention" in type(mod).__name__
    if attention:  # q as wide as the output takes; k and v may be narrower (grouped queries)
        if max(widths) != row_in or any(
            isinstance(getattr(mod, a, None), int) for a in _GLOBAL_SIZES
        ):
            return False
        head_dim = getattr(mod, "head_dim", None)
        if not isinstance(head_dim, int) or any(w % (head_dim * world) for w in widths):
            return False
        return all(_norm_width(m) in (None, head_dim) for m in mod.modules() if m is not mod)
    if any(w != row_in for w in widths):
        return False
    return all(_norm_width(m) is None for m in mod.modules() if m is not mod)


def _width(linear: nn.Module, side: str) -> int | None:
    """The output (``side="out"``) or input width of a linear layer or transformers' Conv1D."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    out_axis = 1 if is_conv1d(linear) else 0
    return int(weight.shape[out_axis if side == "out" else 1 - out_axis])


def _norm_width(mod: nn.Module) -> int | None:
    weight = getattr(mod, "weight", None)
    if is_norm(mod) and isinstance(weight, torch.Tensor):
        return weight.numel()
    return None


def generic_plan(sch: Schedule, k: Knobs) -> None:
    """The generic plan (see the module docstring); ``sch.extra["model_schedule"]`` records the
    blocks and the tensor-parallel plan's source."""
    model = sch.mod
    layers, source = find_blocks(model)
    require(
        bool(layers),
        f"the generic plan found no blocks in {type(model).__name__} (no _no_split_modules, no "
        "list of like modules) to schedule; register a plan for it with "
        "slapo.model_schedule.register_schedule",
    )
    applied: AppliedPlan | None = None
    plan_source = None
    if k.tensor_parallel:
        plan = from_hf_plan(model)
        plan_source = "the model's base_model_tp_plan" if plan is not None else "inferred"
        if plan is None:
            plan = infer_plan(sch, layers)
        applied = apply_tp_plan(sch, plan, layers, k.sequence_parallel)
    head = output_head(model)
    if k.fused_loss:
        require(head is not None, f"fused_loss: {type(model).__name__} has no output embeddings")
        require(
            applied is None or "vocab_embedding" not in applied.sharded,
            "fused_loss with group=: the LM head is split over the vocabulary; drop one of them",
        )
    apply_shared_knobs(sch, k, layers, head or "", shift=True)
    sch.extra["model_schedule_plan"] = {
        "plan": "generic",
        "blocks": len(layers),
        "block_source": source,
        "tp_plan": plan_source,
        **(describe(applied) if applied is not None else {}),
    }
