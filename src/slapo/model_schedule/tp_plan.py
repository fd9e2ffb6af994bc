"""Tensor-parallel plans as data: module-path patterns mapped to parallel styles, applied by one
function through the ``shard`` and ``sync`` primitives.

A plan reads like Hugging Face's ``base_model_tp_plan`` (and is translated from it, see
:func:`from_hf_plan`): ``"model.layers.*.self_attn.q_proj": "colwise"``; ``*`` matches one path
component. The styles:

==================  =========================================================================
``colwise``         split the output features (and the bias); a 3-D expert weight
                    ``[experts, out, in]`` splits ``out``
``packed_colwise``  ``colwise`` of a weight holding two packed projections (gate and up):
                    each half is split on its own
``rowwise``         split the input features; the output is all-reduced (reduce-scattered over
                    the sequence under sequence parallelism); a 3-D expert weight splits ``in``
``colwise_gather``  ``colwise`` whose output is gathered again: what follows sees whole features
                    (fused or interleaved projections, norms over the whole width)
``rowwise_split``   ``rowwise`` that takes this rank's slice of a whole input first
``replicated_grad`` stays whole; its gradient is summed over the group (a norm over each
                    attention head between the column and the row projections)
``vocab_embedding`` an embedding split over the vocabulary; a head tied to it gathers its logits
``experts``         a mixture of experts whose expert weights are split: its output is
                    all-reduced, and so is the gradient of each of its inputs (the hidden
                    states and the routing weights)
``packed_rowwise``  an expert weight stored ``[experts, in, out]`` with gate and up packed
                    along ``out``: each half split on its own (Llama 4)
``embedding_colwise`` an embedding split over its features, gathered again
``reduced``         Hugging Face's ``all_reduce`` of a module: its rowwise projection reduces
``local``           a marker of Hugging Face's (``local_params``, ``replicate``): nothing to do
==================  =========================================================================

A *region* is the module around ``colwise`` and ``rowwise`` projections (an attention or an
MLP): the gradient of its input is all-reduced (Megatron's ``f``), and every parameter of it
that stays whole consumes this rank's shard of the activations, so its gradient is summed over
the group too (Qwen3's ``q_norm``, a router inside a sharded block): the rule that makes a plan
right for every model, not only for those whose replicated parameters someone listed.

Example:
    >>> plan = TPPlan({"model.layers.*.mlp.up_proj": "colwise",
    ...                "model.layers.*.mlp.down_proj": "rowwise"})
    >>> applied = apply_tp_plan(sch, plan)          # sch created with group=
    >>> applied.regions[:1]
    ['model.layers.0.mlp']
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from ..schedule import Schedule
from ..sharding import get_shard_spec
from ..sharding.rules import is_norm
from ..surgery import is_conv1d
from .helpers import column, divide_attrs, enter, replicated, row, tp_size

__all__ = ["STYLES", "HF_STYLES", "TPPlan", "AppliedPlan", "apply_tp_plan", "from_hf_plan"]

STYLES = (
    "colwise",
    "packed_colwise",
    "rowwise",
    "packed_rowwise",
    "colwise_gather",
    "rowwise_split",
    "replicated_grad",
    "vocab_embedding",
    "embedding_colwise",
    "experts",
    "reduced",
    "local",
)

#: Hugging Face's ``base_model_tp_plan`` style names and ours.
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "packed_colwise": "packed_colwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "replicated_with_grad_allreduce": "replicated_grad",
    "embedding_rowwise": "vocab_embedding",
    "moe_tp_experts": "experts",
    # DeepSeek's latent K/V projection stays whole and feeds the sharded heads
    "mla_kv_a_proj": "replicated_grad",
    "packed_rowwise": "packed_rowwise",
    "embedding_colwise": "embedding_colwise",
    "all_reduce": "reduced",
    # markers for Hugging Face's DTensor bookkeeping: the parameters stay as the entries say
    "local_params": "local",
    "replicate": "local",
}

#: Names of projections that pack several in one weight (q/k/v, gate/up) in a model's own layout.
PACKED_NAMES = frozenset(
    {"qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv", "gate_up_proj"}
)
_COLUMN = ("colwise", "packed_colwise")
_ROW = ("rowwise", "packed_rowwise")
#: Styles that work with the sequence split between regions (the embedding comes before it).
_SEQUENCE_READY = (
    "rowwise",
    "colwise_gather",
    "rowwise_split",
    "replicated_grad",
    "vocab_embedding",
    "local",
)
#: Config attributes counting attention heads: a head-parallel plan must split them evenly.
_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


@dataclass(frozen=True)
class TPPlan:
    """A tensor-parallel plan: ``styles`` maps module (or parameter) path patterns to styles.

    Attributes:
        styles: pattern -> one of :data:`STYLES`; ``*`` matches one path component.
        divide: pattern -> attributes of the matched modules that hold global sizes (heads,
            widths) and are divided by the group size.
        head_parallel: the plan splits attention heads (their counts must divide by the group).

    Example:
        >>> TPPlan({"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}).patterns()
        ['h.*.mlp.c_fc', 'h.*.mlp.c_proj']
    """

    styles: Mapping[str, str]
    divide: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    head_parallel: bool = True

    def __post_init__(self) -> None:
        for pattern, style in self.styles.items():
            if style not in STYLES:
                raise SlapoError(
                    f'tensor-parallel plan: "{pattern}" has the style {style!r}; the styles are '
                    f"{', '.join(STYLES)}"
                )

    def patterns(self) -> list[str]:
        return list(self.styles)

    def prefixed(self, prefix: str) -> TPPlan:
        """The plan with ``prefix.`` in front of every pattern (a base model inside a head)."""
        if not prefix:
            return self
        return TPPlan(
            {f"{prefix}.{k}": v for k, v in self.styles.items()},
            {f"{prefix}.{k}": v for k, v in self.divide.items()},
            self.head_parallel,
        )


@dataclass
class AppliedPlan:
    """What :func:`apply_tp_plan` did: the sharded paths per style, the regions, the parameters
    whose gradients it sums, and the entries it found nothing for."""

    sharded: dict[str, list[str]] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)
    summed: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)


def _regex(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def _matches(root: nn.Module, pattern: str) -> list[tuple[str, str]]:
    """``(path, kind)`` of every module (``kind`` "module") or parameter ("param") that
    ``pattern`` names, in model order."""
    regex = _regex(pattern)
    found = [(path, "module") for path, _ in root.named_modules() if path and regex.match(path)]
    if not found:
        found = [(path, "param") for path, _ in root.named_parameters() if regex.match(path)]
    return found


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def apply_tp_plan(
    sch: Schedule,
    plan: TPPlan,
    blocks: list[str] | None = None,
    sequence_parallel: bool = False,
) -> AppliedPlan:
    """Apply ``plan`` to the root schedule ``sch`` (created with the TP ``group``).

    ``blocks``: the repeated blocks, needed with ``sequence_parallel`` (the sequence is split
    from the first block's input to the last block's output). A pattern that matches nothing is
    skipped (plans cover a family's variants); a style the matched module cannot take, heads that
    do not divide, or a replicated parameter the plan cannot place raise a :class:`SlapoError`
    naming the module.

    Example:
        >>> applied = apply_tp_plan(sch, LLAMA_PLAN, blocks(sch, "model.layers"))
    """
    root = sch.mod
    applied = AppliedPlan()
    entries: list[tuple[str, str, str]] = []  # (path, kind, style)
    for pattern, style in plan.styles.items():
        found = _matches(root, pattern)
        if not found:
            applied.unmatched.append(pattern)
        entries.extend((path, kind, style) for path, kind in found)
    if not entries:
        raise SlapoError(
            f"tensor-parallel plan: none of its patterns ({', '.join(plan.patterns())}) names a "
            f"module or parameter of {type(root).__name__}"
        )
    if plan.head_parallel and any(
        style in _COLUMN and _is_attention(_parent(path)) for path, _, style in entries
    ):
        _check_heads(sch)
    if sequence_parallel:
        _check_sequence_parallel(sch, entries, blocks)
    experts = {path for path, _, style in entries if style == "experts"}
    for path, _, style in entries:  # "all_reduce" of a module holding split parameters
        if style == "reduced" and not _holds_row(path, entries):
            experts.add(path)
    _check_widths(sch, entries, experts)
    _check_reducers(entries, experts)
    columns: list[str] = []
    rows: set[str] = set()
    for path, kind, style in entries:
        applied.sharded.setdefault(style, []).append(path)
        if style in ("experts", "local"):
            continue
        if kind == "param":
            _shard_param(sch, path, style)
            continue
        if style == "reduced":
            continue  # reduced by its rowwise projection, or as experts
        _shard_module(sch, path, style, sequence_parallel)
        if style in _COLUMN:
            columns.append(path)
        elif style == "rowwise":
            rows.add(path)
    for path in experts:
        _experts(sch, path)
    applied.regions = _enter_regions(sch, columns, rows, blocks, sequence_parallel)
    if sequence_parallel:
        _gather_sequence_around_split_features(sch, entries, applied.regions, blocks)
    for pattern, attrs in plan.divide.items():
        for path, _ in _matches(root, pattern):
            divide_attrs(sch, path, *attrs)
    applied.summed = _sum_replicated(sch, entries, applied.regions, rows, sequence_parallel)
    if sequence_parallel:
        _split_sequence(sch, blocks or [], applied)
    return applied


# ----- one style ------------------------------------------------------------------------------
def _weighted(sch: Schedule, path: str, style: str) -> nn.Module:
    mod = sch[path].mod
    weight = getattr(mod, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise SlapoError(
            f'tensor-parallel plan: "{path}" ({type(mod).__name__}) has no 2-D weight to shard '
            f"{style}; name a linear layer, or a parameter of an experts module"
        )
    return mod


def _shard_module(sch: Schedule, path: str, style: str, sequence_parallel: bool) -> None:
    if style == "replicated_grad":
        if any(True for _ in sch[path].mod.parameters(recurse=False)):  # a norm may have none
            replicated(sch, path)
        return
    if style == "vocab_embedding":
        _vocab_embedding(sch, path)
        return
    if style == "embedding_colwise":
        _embedding_columns(sch, path)
        return
    if style == "packed_rowwise":
        raise SlapoError(
            f'tensor-parallel plan: "{path}" is a module; packed_rowwise splits a parameter of '
            "an experts module"
        )
    _weighted(sch, path, style)
    if style in ("colwise", "colwise_gather"):
        column(sch, path)
    elif style == "packed_colwise":
        column(sch, path, fused=2)
    elif style == "rowwise":
        row(sch, path, sequence_parallel)
    elif style == "rowwise_split":
        sch[path].sync(mode="fwd_pre", sync_op_or_fn="scatter", dim=-1)
        row(sch, path, sequence_parallel)
    if style == "colwise_gather":
        # its input gradient is this rank's part: all-reduced, or, under sequence parallelism,
        # reduce-scattered by the sequence gather at its parent's entry; whole features after it
        if not sequence_parallel:
            enter(sch, path)
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


def _shard_param(sch: Schedule, path: str, style: str) -> None:
    owner, name = path.rsplit(".", 1)
    param = getattr(sch[owner].mod, name)
    if style == "replicated_grad":
        replicated(sch, owner)
        return
    if style not in _COLUMN + _ROW:
        raise SlapoError(f'tensor-parallel plan: "{path}" is a parameter; {style} needs a module')
    if style in _ROW:  # the last axis; packed: gate and up side by side along it
        axis = param.dim() - 1
    else:  # [experts, out, in] or [out, in]: the output axis; a 1-D parameter (sinks) splits
        axis = max(param.dim() - 2, 0)
    sch[owner].shard(name, axis=axis, fused=2 if style.startswith("packed") else 1)


def _vocab_embedding(sch: Schedule, path: str) -> None:
    mod = sch[path].mod
    if not isinstance(mod, nn.Embedding):
        raise SlapoError(
            f'tensor-parallel plan: "{path}" ({type(mod).__name__}) is no nn.Embedding; '
            "vocab_embedding splits an embedding table over its rows"
        )
    if mod.num_embeddings % tp_size(sch):
        return  # stays whole: right, only not split (the vocabulary does not divide)
    weight = mod.weight
    heads = [
        p
        for p, m in sch.mod.named_modules()
        if p != path and getattr(m, "weight", None) is weight and not isinstance(m, nn.Embedding)
    ]
    sch[path].shard("weight", axis=0)
    sch[path].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    for head in heads:  # a tied LM head now computes this rank's slice of the logits
        sch[head].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch[head].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


def _embedding_columns(sch: Schedule, path: str) -> None:
    mod = sch[path].mod
    if not isinstance(mod, nn.Embedding):
        raise SlapoError(
            f'tensor-parallel plan: "{path}" ({type(mod).__name__}) is no nn.Embedding; '
            "embedding_colwise splits an embedding table over its features"
        )
    sch[path].shard("weight", axis=1)
    sch[path].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


def _check_reducers(entries: list[tuple[str, str, str]], experts: set[str]) -> None:
    """Before anything is split: every column split must be reduced somewhere (a rowwise
    projection; for a split parameter, its experts module or its region's)."""
    modules = [p for p, kind, style in entries if kind == "module" and style in _COLUMN]
    if modules and not any(s == "rowwise" for _, _, s in entries):
        raise SlapoError(
            f'tensor-parallel plan: "{modules[0]}" is split by columns but the plan has no '
            "rowwise projection to reduce it; its output would stay split"
        )
    regions = {_parent(p) for p in modules}
    for path, kind, style in entries:
        owner = _parent(path)
        split = style in (*_COLUMN, *_ROW)
        if kind == "param" and split and owner not in experts and owner not in regions:
            raise SlapoError(
                f'tensor-parallel plan: "{path}" is a parameter split {style}, but its module '
                f'"{owner}" is neither marked "experts" nor a region of split projections; '
                "nothing would reduce what it computes"
            )


def _holds_row(path: str, entries: list[tuple[str, str, str]]) -> bool:
    return any(
        style == "rowwise" and kind == "module" and p.startswith(path + ".")
        for p, kind, style in entries
    )


def _split_width(sch: Schedule, path: str, kind: str, style: str) -> int | None:
    """The size of the axis ``style`` splits (per packed half), before it is split."""
    if kind == "param":
        owner, name = path.rsplit(".", 1)
        param = getattr(sch[owner].mod, name)
        size = param.shape[-1] if style in _ROW else param.shape[max(param.dim() - 2, 0)]
    else:
        mod = sch[path].mod
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        out_axis = 1 if is_conv1d(mod) else 0
        size = weight.shape[out_axis if style in _COLUMN else 1 - out_axis]
    return int(size) // (2 if style.startswith("packed") else 1)


def _check_widths(sch: Schedule, entries: list[tuple[str, str, str]], experts: set[str]) -> None:
    """Refuse a plan whose split projections do not meet: the features a region's column
    projections produce must be the ones its row projection takes, else a packed or interleaved
    weight (gate and up in one) would be split across its halves and give other numbers."""
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for path, kind, style in entries:
        if style in (*_COLUMN, *_ROW):
            groups.setdefault(_parent(path), []).append((path, kind, style))
    for owner, members in groups.items():
        if owner in experts:  # every expert weight splits the same intermediate width
            widths = {p: _split_width(sch, p, k, s) for p, k, s in members}
            if len(set(widths.values())) > 1:
                _refuse_widths(owner, widths)
            continue
        cols = {p: _split_width(sch, p, k, s) for p, k, s in members if s in _COLUMN}
        rows = {p: _split_width(sch, p, k, s) for p, k, s in members if s in _ROW}
        if not cols or not rows or None in (*cols.values(), *rows.values()):
            continue
        (row_width,) = set(rows.values()) if len(set(rows.values())) == 1 else (None,)
        if _is_attention(owner):
            # heads split whole (checked apart); a packed q/k/v split by columns is right when
            # the model packs it per head (GPT-NeoX), which its own plan then says
            fits = True
        else:
            fits = set(cols.values()) == {row_width}
        if not fits:
            _refuse_widths(owner, {**cols, **rows})


def _refuse_widths(owner: str, widths: dict[str, int | None]) -> None:
    listed = ", ".join(f'"{p.rsplit(".", 1)[-1]}" {w}' for p, w in widths.items())
    raise SlapoError(
        f'tensor-parallel plan: the split projections of "{owner}" do not meet ({listed} '
        "features): a weight packing two projections (gate and up) would be split across its "
        "halves; give it packed_colwise, or colwise_gather and rowwise_split"
    )


def _experts(sch: Schedule, path: str) -> None:
    mod = sch[path].mod
    whole = [n for n, p in mod.named_parameters() if get_shard_spec(p) is None]
    if whole:
        # e.g. a down-projection bias, added by every rank before the sum: counted world times
        raise SlapoError(
            f'tensor-parallel plan: experts "{path}" keeps {", ".join(whole)} whole while its '
            "projections are split; the plan cannot place them (give them a style, or leave "
            "the experts unsharded)"
        )
    sch[path].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch[path].sync(mode="bwd_post", sync_op_or_fn="all_reduce", inputs="all")


# ----- checks -----------------------------------------------------------------------------------
def _check_heads(sch: Schedule) -> None:
    world = tp_size(sch)
    config = getattr(sch.mod, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for attr in _HEAD_ATTRS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and count % world:
            raise SlapoError(
                f"tensor parallelism over {world} ranks would split a head: config.{attr} = "
                f"{count} does not divide by {world}; use a group size that divides it"
            )


def _is_attention(path: str) -> bool:
    return "att" in path.rsplit(".", 1)[-1].lower()


def _enter_regions(
    sch: Schedule,
    columns: list[str],
    rows: set[str],
    blocks: list[str] | None,
    sequence_parallel: bool,
) -> list[str]:
    """All-reduce the input gradient of each region (or gather the sequence entering it);
    returns the regions. Projections placed directly in a block (OPT's ``fc1``/``fc2``) have no
    module of their own around them: each column projection is entered by itself."""
    regions: dict[str, None] = {}
    for path in columns:
        region = _parent(path)
        if region == "" or (blocks is not None and region in blocks):
            if sequence_parallel:
                raise SlapoError(
                    f'sequence_parallel: "{path}" sits directly in its block; the sequence '
                    "can only be gathered at the entry of a module of its own"
                )
            enter(sch, path)
        else:
            regions.setdefault(region)
    for region in regions:
        enter(sch, region, sequence_parallel)
    return list(regions)


def _gather_sequence_around_split_features(
    sch: Schedule,
    entries: list[tuple[str, str, str]],
    regions: list[str],
    blocks: list[str] | None,
) -> None:
    """Under sequence parallelism, gather the whole sequence at the entry of each module holding
    ``colwise_gather`` projections (an attention reads its sequence length from its input):
    inside, every rank computes on whole sequences; its ``rowwise_split`` projection
    reduce-scatters back to this rank's slice."""
    parents = {_parent(p) for p, _, style in entries if style == "colwise_gather"}
    for parent in sorted(parents - set(regions)):
        if parent == "" or (blocks is not None and parent in blocks):
            raise SlapoError(
                f'sequence_parallel: the split projections of "{parent}" sit directly in a '
                "block; the sequence can only be gathered at the entry of a module of its own"
            )
        if not any(s == "rowwise_split" and _parent(p) == parent for p, _, s in entries):
            raise SlapoError(
                f'sequence_parallel: "{parent}" gathers its features but has no rowwise_split '
                "projection to return to this rank's slice of the sequence"
            )
        enter(sch, parent, sequence_parallel=True)


def _check_sequence_parallel(
    sch: Schedule, entries: list[tuple[str, str, str]], blocks: list[str] | None
) -> None:
    if not blocks:
        raise SlapoError("sequence_parallel needs the model's blocks (pass blocks=)")
    other = {style for _, _, style in entries} - {*_COLUMN, *_SEQUENCE_READY}
    if other:
        raise SlapoError(
            f"sequence_parallel: the plan uses {', '.join(sorted(other))}; sequence "
            "parallelism is implemented for projections split by columns and rows only"
        )
    regions = {_parent(path) for path, _, style in entries if style != "replicated_grad"}
    for blk in blocks:
        for name, child in sch[blk].mod.named_children():
            path = f"{blk}.{name}"
            if path in regions or is_norm(child) or isinstance(child, (nn.Dropout, nn.Identity)):
                continue
            if not any(True for _ in child.parameters()) and not _mixes_tokens(child):
                continue
            raise SlapoError(
                f'sequence_parallel: "{path}" ({type(child).__name__}) runs between the '
                "tensor-parallel regions, where each rank holds a slice of the sequence, and "
                "is neither a region nor a norm; it may mix tokens, so the sequence cannot be "
                "split around it"
            )


def _mixes_tokens(mod: nn.Module) -> bool:
    return "attn" in type(mod).__name__.lower() or "conv" in type(mod).__name__.lower()


# ----- replicated parameters --------------------------------------------------------------------
def _sum_replicated(
    sch: Schedule,
    entries: list[tuple[str, str, str]],
    regions: list[str],
    rows: set[str],
    sequence_parallel: bool,
) -> list[str]:
    """Sum the gradients of the parameters that stay whole inside a region over the group.

    They consume this rank's shard of the activations (a per-head norm, a router feeding split
    experts): each rank's gradient is a part of the whole. A rowwise projection's bias is added
    after the all-reduce (whole activations) and is left alone, unless the sequence is split.
    """
    marked = {path for path, kind, style in entries if style == "replicated_grad"}
    summed: list[str] = []
    for region in regions:
        for name, mod in sch[region].mod.named_modules():
            path = f"{region}.{name}" if name else region
            own = [p for p in mod.parameters(recurse=False) if get_shard_spec(p) is None]
            if not own or path in marked:
                continue
            if path in rows and not sequence_parallel:
                continue
            replicated(sch, path)
            summed.append(path)
    if sequence_parallel:  # the row projections' biases meet a slice of the sequence
        rows = rows | {path for path, kind, style in entries if style == "rowwise_split"}
        for path in rows - set(summed):
            if any(get_shard_spec(p) is None for p in sch[path].mod.parameters(recurse=False)):
                replicated(sch, path)  # its bias meets a slice of the sequence
                summed.append(path)
    return summed


def _split_sequence(sch: Schedule, blocks: list[str], applied: AppliedPlan) -> None:
    """Split the sequence from the first block's input to the last block's output; the norms
    and other replicated modules between the regions see a slice of it: sum their gradients."""
    regions = {_parent(p) for paths in applied.sharded.values() for p in paths}
    for blk in blocks:
        for name, child in sch[blk].mod.named_children():
            path = f"{blk}.{name}"
            if path in regions:
                continue
            if any(get_shard_spec(p) is None for p in child.parameters(recurse=False)):
                replicated(sch, path)
                applied.summed.append(path)
    sch[blocks[0]].sync(mode="fwd_pre", sync_op_or_fn="scatter", dim=1)
    sch[blocks[-1]].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=1)


# ----- Hugging Face plans -------------------------------------------------------------------------
def from_hf_plan(model: nn.Module) -> TPPlan | None:
    """Our plan from the model's own ``config.base_model_tp_plan`` (None when it has none).

    Patterns are relative to the base model; they get its prefix (``model.``). The LM head stays
    whole (its logits are whole on every rank). A style without a counterpart here raises a
    :class:`SlapoError` naming it.

    Example:
        >>> from_hf_plan(LlamaForCausalLM(config)).styles["model.layers.*.self_attn.q_proj"]
        'colwise'
    """
    config = getattr(model, "config", None)
    hf = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not hf:
        return None
    unknown = {k: v for k, v in hf.items() if v not in HF_STYLES}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise SlapoError(
            f'tensor parallelism: {type(model).__name__}\'s own plan gives "{pattern}" the '
            f"style {style!r}, which slapo does not implement; the styles it translates are "
            f"{', '.join(HF_STYLES)}"
        )
    styles = {k: HF_STYLES[v] for k, v in hf.items()}
    return TPPlan(styles).prefixed(_base_prefix(model, list(styles)))


def _base_prefix(model: nn.Module, patterns: list[str]) -> str:
    """Where the base model sits: ``base_model_prefix`` when the model has it, else the first
    of ``model`` and the root whose modules the patterns name (Llama 4 declares a prefix its
    text model does not use)."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    for candidate in ("model", ""):
        plan = TPPlan({p: "local" for p in patterns}).prefixed(candidate)
        if any(_matches(model, p) for p in plan.patterns()):
            return candidate
    return ""


def describe(applied: AppliedPlan) -> dict[str, Any]:
    """A JSON-friendly summary of an applied plan (for ``sch.extra``)."""
    return {
        "sharded": {style: len(paths) for style, paths in applied.sharded.items()},
        "regions": len(applied.regions),
        "summed": len(applied.summed),
    }


def is_linear(mod: nn.Module) -> bool:
    """Whether ``mod`` is a linear layer a plan can split (``nn.Linear`` or transformers'
    ``Conv1D``)."""
    return isinstance(mod, nn.Linear) or is_conv1d(mod)
