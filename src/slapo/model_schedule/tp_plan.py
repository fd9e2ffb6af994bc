"""Tensor-parallel plans as data: module-path patterns mapped to parallel styles
(:mod:`~slapo.model_schedule.tp_styles`), applied by one function through the ``shard`` and
``sync`` primitives.

A plan reads like Hugging Face's ``base_model_tp_plan`` (and is translated from it, see
:func:`from_hf_plan`): ``"model.layers.*.self_attn.q_proj": "colwise"``; ``*`` matches one path
component. A plan holds style values (a name is read into its value); it prints as the code that
makes it and round-trips through JSON (:meth:`TPPlan.to_json`, :meth:`TPPlan.from_json`). The
styles, one class each in ``tp_styles``:

==================== ==========================================================================
``colwise``          split the output features (and the bias); a 3-D expert weight
                     ``[experts, out, in]`` splits ``out``
``packed_colwise``   ``colwise`` of a weight holding ``parts`` packed projections (gate and up;
                     GPT-2's q/k/v: ``parts=3``): each is split on its own
``colwise_cross``    ``colwise`` whose input comes from outside the region (T5's cross
                     attention k and v): that input's gradient is all-reduced at it
``rowwise``          split the input features; the output is all-reduced (reduce-scattered over
                     the sequence under sequence parallelism); a 3-D expert weight splits ``in``
``colwise_gather``   ``colwise`` whose output is gathered again: what follows sees whole
                     features (fused or interleaved projections, norms over the whole width)
``rowwise_split``    ``rowwise`` that takes this rank's slice of a whole input first
``replicated_grad``  stays whole; its gradient is summed over the group (a norm over each
                     attention head between the column and the row projections)
``vocab_embedding``  an embedding split over the vocabulary; a head tied to it gathers its logits
``relative_bias``    an embedding over the attention heads (T5's relative position bias), split
                     with them
``experts``          a mixture of experts whose expert weights are split: its output is
                     all-reduced, and so is the gradient of each of its inputs (the hidden
                     states and the routing weights)
``packed_rowwise``   an expert weight stored ``[experts, in, out]`` with gate and up packed
                     along ``out``: each half split on its own (Llama 4)
``embedding_colwise`` an embedding split over its features, gathered again
``reduced``          Hugging Face's ``all_reduce`` of a module: its rowwise projection reduces
``local``            a marker of Hugging Face's (``local_params``, ``replicate``): nothing to do
==================== ==========================================================================

A *region* is the module around ``colwise`` and ``rowwise`` projections (an attention or an
MLP): the gradient of its input is all-reduced (Megatron's ``f``), and every parameter of it
that stays whole consumes this rank's shard of the activations, so its gradient is summed over
the group too (Qwen3's ``q_norm``, a router inside a sharded block): the rule that makes a plan
right for every model, not only for those whose replicated parameters someone listed.

Example:
    >>> plan = TPPlan({"model.layers.*.mlp.up_proj": "colwise",
    ...                "model.layers.*.mlp.down_proj": "rowwise"})
    >>> plan
    TPPlan({
        'model.layers.*.mlp.up_proj': Colwise(),
        'model.layers.*.mlp.down_proj': Rowwise(),
    })
    >>> TPPlan.from_json(plan.to_json()) == plan
    True
    >>> import slapo, transformers
    >>> config = transformers.LlamaConfig(
    ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
    ... )
    >>> model = transformers.LlamaForCausalLM(config)
    >>> # illustration: sch is a schedule created with group=, on each rank of a tp job (torchrun)
    >>> tp_group = slapo.sharding.init_parallel_mesh("cpu", tp=2)["tp"]  # doctest: +SKIP
    >>> sch = slapo.create_schedule(model, group=tp_group)  # doctest: +SKIP
    >>> apply_tp_plan(sch, plan).regions[:1]  # doctest: +SKIP
    ['model.layers.0.mlp']
"""

from __future__ import annotations

import json
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
from .helpers import divide_attrs, enter, replicated, tp_size
from .tp_styles import HF_STYLES, REGISTRY, Style, TPStyleError, parse_style

__all__ = ["STYLES", "HF_STYLES", "TPPlan", "AppliedPlan", "apply_tp_plan", "from_hf_plan"]

#: The names of the styles (a plan may write a style by its name).
STYLES = tuple(REGISTRY)

#: Names of projections that pack several in one weight (q/k/v, gate/up) in a model's own layout.
PACKED_NAMES = frozenset(
    {"qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv", "gate_up_proj"}
)
#: Config attributes counting attention heads: a head-parallel plan must split them evenly.
_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")

#: One matched plan entry: (path, "module" or "param", style).
Entry = tuple[str, str, Style]


@dataclass(frozen=True)
class TPPlan:
    """A tensor-parallel plan: ``styles`` maps module (or parameter) path patterns to styles.

    Attributes:
        styles: pattern -> a style value (given as a value, a name of :data:`STYLES`, or the
            JSON form ``{"style": name, **fields}``); ``*`` matches one path component.
        divide: pattern -> attributes of the matched modules that hold global sizes (heads,
            widths) and are divided by the group size.
        head_parallel: the plan splits attention heads (their counts must divide by the group).

    Example:
        >>> TPPlan({"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}).patterns()
        ['h.*.mlp.c_fc', 'h.*.mlp.c_proj']
        >>> from slapo.model_schedule.tp_styles import PackedColwise
        >>> TPPlan({"h.*.attn.c_attn": PackedColwise(parts=3)}, {"h.*.attn": ("num_heads",)})
        TPPlan({
            'h.*.attn.c_attn': PackedColwise(parts=3),
        }, divide={'h.*.attn': ('num_heads',)})
    """

    styles: Mapping[str, Style]
    divide: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    head_parallel: bool = True

    def __post_init__(self) -> None:
        # plans are written with names; they hold values (an unknown name: TPStyleError)
        styles = {p: parse_style(s, p) for p, s in self.styles.items()}
        object.__setattr__(self, "styles", styles)
        object.__setattr__(self, "divide", {p: tuple(a) for p, a in self.divide.items()})

    def __repr__(self) -> str:
        lines = "".join(f"\n    {p!r}: {s!r}," for p, s in self.styles.items())
        extra = f", divide={dict(self.divide)!r}" if self.divide else ""
        extra += "" if self.head_parallel else ", head_parallel=False"
        return f"TPPlan({{{lines}\n}}{extra})"

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

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (styles by name, or ``{"style": ..., **fields}``)."""
        return {
            "styles": {p: s.to_json() for p, s in self.styles.items()},
            "divide": {p: list(a) for p, a in self.divide.items()},
            "head_parallel": self.head_parallel,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TPPlan:
        """The plan :meth:`to_dict` gave (a bare ``{pattern: style}`` mapping reads as styles)."""
        if "styles" not in data:
            return cls(dict(data))
        return cls(data["styles"], data.get("divide", {}), data.get("head_parallel", True))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TPPlan:
        return cls.from_dict(json.loads(text))


@dataclass
class AppliedPlan:
    """What :func:`apply_tp_plan` did: the sharded paths per style name, the regions, the
    parameters whose gradients it sums, and the entries it found nothing for."""

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
    naming the module. Each entry's style applies itself; what spans entries (regions, the
    sequence, the checks) is done here from the styles' attributes.

    Example (illustration: ``sch`` needs a process group):
        >>> import slapo, transformers
        >>> from slapo.model_schedule.helpers import blocks
        >>> from slapo.model_schedule.llama import LLAMA_PLAN
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> # on each rank of a tensor-parallel job (torchrun): not run here
        >>> tp_group = slapo.sharding.init_parallel_mesh("cpu", tp=2)["tp"]  # doctest: +SKIP
        >>> sch = slapo.create_schedule(model, group=tp_group)  # doctest: +SKIP
        >>> applied = apply_tp_plan(sch, LLAMA_PLAN, blocks(sch, "model.layers"))  # doctest: +SKIP
    """
    applied = AppliedPlan()
    entries = _resolve(sch.mod, plan, applied)
    experts = _check(sch, plan, entries, blocks, sequence_parallel)
    for path, kind, style in entries:
        applied.sharded.setdefault(style.name, []).append(path)
        if kind == "param":
            style.apply_param(sch, path)
        else:
            style.apply(sch, path, sequence_parallel)
    for path in experts:
        _experts(sch, path)
    columns = [p for p, kind, s in entries if kind == "module" and s.role == "column"]
    rows = {p for p, kind, s in entries if kind == "module" and s.closes_region}
    applied.regions = _enter_regions(sch, columns, blocks, sequence_parallel)
    if sequence_parallel:
        _gather_sequence_around_split_features(sch, entries, applied.regions, blocks)
    for pattern, attrs in plan.divide.items():
        for path, _ in _matches(sch.mod, pattern):
            divide_attrs(sch, path, *attrs)
    applied.summed = _sum_replicated(sch, entries, applied.regions, rows, sequence_parallel)
    if sequence_parallel:
        _split_sequence(sch, blocks or [], applied)
    return applied


def _resolve(root: nn.Module, plan: TPPlan, applied: AppliedPlan) -> list[Entry]:
    """The plan's entries, pattern by pattern in model order; the unmatched patterns noted."""
    entries: list[Entry] = []
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
    return entries


def _check(
    sch: Schedule,
    plan: TPPlan,
    entries: list[Entry],
    blocks: list[str] | None,
    sequence_parallel: bool,
) -> set[str]:
    """Refuse, before anything is split, a plan that cannot be right; returns the modules
    reduced as experts."""
    if plan.head_parallel and any(
        style.role == "column" and _is_attention(_parent(path)) for path, _, style in entries
    ):
        _check_heads(sch)
    if sequence_parallel:
        _check_sequence_parallel(sch, entries, blocks)
    experts = {
        path for path, _, style in entries if style.reduced_as_experts(_holds_row(path, entries))
    }
    _check_widths(sch, entries, experts)
    _check_reducers(entries, experts)
    return experts


def _check_reducers(entries: list[Entry], experts: set[str]) -> None:
    """Every column split must be reduced somewhere (a rowwise projection; for a split
    parameter, its experts module or its region's)."""
    modules = [p for p, kind, style in entries if kind == "module" and style.role == "column"]
    if modules and not any(s.closes_region for _, _, s in entries):
        raise SlapoError(
            f'tensor-parallel plan: "{modules[0]}" is split by columns but the plan has no '
            "rowwise projection to reduce it; its output would stay split"
        )
    regions = {_parent(p) for p in modules}
    for path, kind, style in entries:
        owner = _parent(path)
        if kind == "param" and style.role and owner not in experts and owner not in regions:
            raise SlapoError(
                f'tensor-parallel plan: "{path}" is a parameter split {style}, but its module '
                f'"{owner}" is neither marked "experts" nor a region of split projections; '
                "nothing would reduce what it computes"
            )


def _holds_row(path: str, entries: list[Entry]) -> bool:
    return any(
        style.closes_region and kind == "module" and p.startswith(path + ".")
        for p, kind, style in entries
    )


def _split_width(sch: Schedule, path: str, kind: str, style: Style) -> int | None:
    """The size of the axis ``style`` splits (per packed part), before it is split."""
    if kind == "param":
        owner, name = path.rsplit(".", 1)
        param = getattr(sch[owner].mod, name)
        size = param.shape[-1] if style.role == "row" else param.shape[max(param.dim() - 2, 0)]
    else:
        mod = sch[path].mod
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        out_axis = 1 if is_conv1d(mod) else 0
        size = weight.shape[out_axis if style.role == "column" else 1 - out_axis]
    return int(size) // style.parts


def _check_widths(sch: Schedule, entries: list[Entry], experts: set[str]) -> None:
    """Refuse a plan whose split projections do not meet: the features a region's column
    projections produce must be the ones its row projection takes, else a packed or interleaved
    weight (gate and up in one) would be split across its halves and give other numbers."""
    groups: dict[str, list[Entry]] = {}
    for path, kind, style in entries:
        if style.role:
            groups.setdefault(_parent(path), []).append((path, kind, style))
    for owner, members in groups.items():
        widths = {p: _split_width(sch, p, k, s) for p, k, s in members}
        if owner in experts:  # every expert weight splits the same intermediate width
            if len(set(widths.values())) > 1:
                _refuse_widths(owner, widths)
            continue
        cols = {p: widths[p] for p, _, s in members if s.role == "column"}
        rows = {p: widths[p] for p, _, s in members if s.role == "row"}
        if not cols or not rows or None in widths.values() or _is_attention(owner):
            # heads split whole (checked apart); a packed q/k/v split by columns is right when
            # the model packs it per head (GPT-NeoX), which its own plan then says
            continue
        row_width = next(iter(rows.values())) if len(set(rows.values())) == 1 else None
        if set(cols.values()) != {row_width}:
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
    entries: list[Entry],
    regions: list[str],
    blocks: list[str] | None,
) -> None:
    """Under sequence parallelism, gather the whole sequence at the entry of each module holding
    ``colwise_gather`` projections (an attention reads its sequence length from its input):
    inside, every rank computes on whole sequences; its ``rowwise_split`` projection
    reduce-scatters back to this rank's slice."""
    parents = {_parent(p) for p, _, style in entries if style.gathers}
    for parent in sorted(parents - set(regions)):
        if parent == "" or (blocks is not None and parent in blocks):
            raise SlapoError(
                f'sequence_parallel: the split projections of "{parent}" sit directly in a '
                "block; the sequence can only be gathered at the entry of a module of its own"
            )
        if not any(s.scatters and _parent(p) == parent for p, _, s in entries):
            raise SlapoError(
                f'sequence_parallel: "{parent}" gathers its features but has no rowwise_split '
                "projection to return to this rank's slice of the sequence"
            )
        enter(sch, parent, sequence_parallel=True)


def _check_sequence_parallel(sch: Schedule, entries: list[Entry], blocks: list[str] | None) -> None:
    if not blocks:
        raise SlapoError("sequence_parallel needs the model's blocks (pass blocks=)")
    other = {style.name for _, _, style in entries if not style.sequence_ready}
    if other:
        raise SlapoError(
            f"sequence_parallel: the plan uses {', '.join(sorted(other))}; sequence "
            "parallelism is implemented for projections split by columns and rows only"
        )
    regions = {_parent(path) for path, _, style in entries if not style.keeps_whole}
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
    entries: list[Entry],
    regions: list[str],
    rows: set[str],
    sequence_parallel: bool,
) -> list[str]:
    """Sum the gradients of the parameters that stay whole inside a region over the group.

    They consume this rank's shard of the activations (a per-head norm, a router feeding split
    experts): each rank's gradient is a part of the whole. A rowwise projection's bias is added
    after the all-reduce (whole activations) and is left alone, unless the sequence is split.
    """
    marked = {path for path, _, style in entries if style.keeps_whole}
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
        rows = rows | {path for path, _, style in entries if style.scatters}
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
    whole (its logits are whole on every rank). Each Hugging Face style name reads as the style
    :data:`HF_STYLES` gives it; one without a counterpart raises a :class:`TPStyleError` naming
    it.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2)
        >>> plan = from_hf_plan(transformers.LlamaForCausalLM(config))
        >>> plan.styles["model.layers.*.self_attn.q_proj"], plan.styles["model.layers.*.mlp.down_proj"]
        (Colwise(), Rowwise())
    """
    config = getattr(model, "config", None)
    hf = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not hf:
        return None
    unknown = {k: v for k, v in hf.items() if v not in HF_STYLES}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise TPStyleError(
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
