"""Tensor-parallel styles as values: each style is one small frozen dataclass that says what it
does to the module (or parameter) a plan gives it, through the ``shard`` and ``sync`` primitives.

A style has two methods, :meth:`Style.apply` (a module) and :meth:`Style.apply_param` (a
parameter), and a few class attributes that the plan-wide checks of
:func:`~slapo.model_schedule.tp_plan.apply_tp_plan` read instead of its name (``role``: which
side of a region it splits; ``sequence_ready``: it works with the sequence split between
regions; ...). A style defined here registers itself under its ``name``: adding one touches this
file only. Hugging Face's ``base_model_tp_plan`` names map to style values in :data:`HF_STYLES`.

Example:
    >>> Colwise(), PackedColwise(parts=3)
    (Colwise(), PackedColwise(parts=3))
    >>> str(PackedColwise(parts=3)), Colwise() == "colwise"
    ('packed_colwise(parts=3)', True)
    >>> parse_style({"style": "packed_colwise", "parts": 3}, "transformer.h.*.attn.c_attn")
    PackedColwise(parts=3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..exceptions import SlapoError
from ..schedule import Schedule
from .helpers import column, enter, replicated, row, tp_size

__all__ = [
    "Style",
    "TPStyleError",
    "REGISTRY",
    "HF_STYLES",
    "parse_style",
    "Colwise",
    "PackedColwise",
    "Rowwise",
    "PackedRowwise",
    "ColwiseGather",
    "RowwiseSplit",
    "ColwiseCross",
    "ReplicatedGrad",
    "VocabEmbedding",
    "EmbeddingColwise",
    "RelativeBias",
    "Experts",
    "Reduced",
    "Local",
]

#: Style name -> class, filled by :class:`Style` subclasses as they are defined.
REGISTRY: dict[str, type[Style]] = {}


class TPStyleError(SlapoError, ValueError):
    """A plan entry whose style is none of :data:`REGISTRY`'s (or cannot be read)."""


@dataclass(frozen=True, eq=False)
class Style:
    """One tensor-parallel style. Subclasses set ``name`` and override :meth:`apply` (and
    :meth:`apply_param` where a parameter can take the style).

    A style equals another of its class with the same fields, and, for plans written as
    strings, the string it prints as (``Colwise() == "colwise"``).
    """

    #: The name a plan (and its JSON) writes the style with.
    name: ClassVar[str] = ""
    #: ``"column"`` or ``"row"``: the style splits the inputs or the output of a region (a
    #: module of split projections, whose input gradient is all-reduced); None: neither.
    role: ClassVar[str | None] = None
    #: Its output is reduced over the group: it closes the region around it.
    closes_region: ClassVar[bool] = False
    #: It works with the sequence split between the regions (``sequence_parallel``).
    sequence_ready: ClassVar[bool] = False
    #: It stays whole and sums its gradient itself: the region rule leaves it alone.
    keeps_whole: ClassVar[bool] = False
    #: Its output is gathered again to whole features (the sequence is gathered around it).
    gathers: ClassVar[bool] = False
    #: It takes this rank's slice of a whole input (and returns to a slice of the sequence).
    scatters: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY[cls.name] = cls

    @property
    def parts(self) -> int:
        """How many projections the split weight packs (each is split on its own)."""
        return 1

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        """Apply the style to the module at ``path`` of the root schedule ``sch``."""
        raise NotImplementedError

    def apply_param(self, sch: Schedule, path: str) -> None:
        """Apply the style to the parameter at ``path`` (``owner.name``)."""
        raise SlapoError(f'tensor-parallel plan: "{path}" is a parameter; {self} needs a module')

    def reduced_as_experts(self, holds_row: bool) -> bool:
        """Whether the module's output (and its inputs' gradients) are all-reduced as a mixture
        of experts' (``holds_row``: a rowwise projection inside it reduces it already)."""
        return False

    # ----- a value: compared, hashed, printed and stored by its fields ------------------------
    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _changed(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }

    def __str__(self) -> str:
        changed = self._changed()
        args = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"{self.name}({args})" if changed else self.name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str(self) == other
        return type(other) is type(self) and self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(str(self))

    def to_json(self) -> str | dict[str, Any]:
        """The JSON form: the name, or ``{"style": name, **fields}`` when a field is not its
        default."""
        changed = self._changed()
        return {"style": self.name, **changed} if changed else self.name


def parse_style(spec: str | Mapping[str, Any] | Style, path: str) -> Style:
    """The style value of ``spec``: a style, a name of :data:`REGISTRY`, or the JSON form
    ``{"style": name, **fields}``; ``path`` names the plan entry in the error.

    Example:
        >>> parse_style("rowwise", "model.layers.*.mlp.down_proj")
        Rowwise()
    """
    if isinstance(spec, Style):
        return spec
    fields: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        fields = {k: v for k, v in spec.items() if k != "style"}
        spec = spec.get("style", "")
    cls = REGISTRY.get(spec) if isinstance(spec, str) else None
    if cls is None:
        raise TPStyleError(
            f'tensor-parallel plan: "{path}" has the style {spec!r}; the styles are '
            f"{', '.join(REGISTRY)}"
        )
    try:
        return cls(**fields)
    except TypeError as exc:
        raise TPStyleError(
            f'tensor-parallel plan: "{path}": the style {cls.name} takes '
            f"{[f.name for f in dataclasses.fields(cls)] or 'no fields'}, not {fields} ({exc})"
        ) from exc


# ----- the styles -------------------------------------------------------------------------------
def _weighted(sch: Schedule, path: str, style: Style) -> nn.Module:
    mod = sch[path].mod
    weight = getattr(mod, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise SlapoError(
            f'tensor-parallel plan: "{path}" ({type(mod).__name__}) has no 2-D weight to shard '
            f"{style}; name a linear layer, or a parameter of an experts module"
        )
    return mod


def _embedding(sch: Schedule, path: str, style: Style, what: str) -> nn.Embedding:
    mod = sch[path].mod
    if not isinstance(mod, nn.Embedding):
        raise SlapoError(
            f'tensor-parallel plan: "{path}" ({type(mod).__name__}) is no nn.Embedding; '
            f"{style} splits an embedding table over its {what}"
        )
    return mod


def _shard_param(sch: Schedule, path: str, axis_from_end: int, parts: int) -> None:
    """Split parameter ``path`` on its last axis (``axis_from_end=1``) or the one before it (the
    output axis of ``[experts, out, in]`` or ``[out, in]``; a 1-D parameter splits its only
    axis), each of its ``parts`` packed halves on its own."""
    owner, name = path.rsplit(".", 1)
    dim = getattr(sch[owner].mod, name).dim()
    sch[owner].shard(name, axis=max(dim - axis_from_end, 0), fused=parts)


@dataclass(frozen=True, eq=False)
class Colwise(Style):
    """Split the output features (and the bias); a 3-D expert weight ``[experts, out, in]``
    splits ``out``."""

    name = "colwise"
    role = "column"
    sequence_ready = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _weighted(sch, path, self)
        column(sch, path, fused=self.parts)

    def apply_param(self, sch: Schedule, path: str) -> None:
        _shard_param(sch, path, 2, self.parts)


@dataclass(frozen=True, eq=False)
class PackedColwise(Colwise):
    """``colwise`` of a weight packing ``parts`` projections (gate and up; GPT-2's q, k and v:
    ``parts=3``): each is split on its own."""

    name = "packed_colwise"
    parts: int = 2  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class ColwiseCross(Colwise):
    """``colwise`` of a projection whose input comes from outside its region (T5's cross
    attention: k and v read the encoder states): the gradient of that input is all-reduced at
    the projection itself."""

    name = "colwise_cross"
    sequence_ready = False

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        super().apply(sch, path, sequence_parallel)
        enter(sch, path)


@dataclass(frozen=True, eq=False)
class Rowwise(Style):
    """Split the input features; the output is all-reduced (reduce-scattered over the sequence
    under sequence parallelism); a 3-D expert weight splits ``in``."""

    name = "rowwise"
    role = "row"
    closes_region = True
    sequence_ready = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _weighted(sch, path, self)
        row(sch, path, sequence_parallel)

    def apply_param(self, sch: Schedule, path: str) -> None:
        _shard_param(sch, path, 1, self.parts)


@dataclass(frozen=True, eq=False)
class PackedRowwise(Style):
    """An expert weight stored ``[experts, in, out]`` with gate and up packed along ``out``:
    each half split on its own (Llama 4)."""

    name = "packed_rowwise"
    role = "row"

    @property
    def parts(self) -> int:
        return 2

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        raise SlapoError(
            f'tensor-parallel plan: "{path}" is a module; packed_rowwise splits a parameter of '
            "an experts module"
        )

    def apply_param(self, sch: Schedule, path: str) -> None:
        _shard_param(sch, path, 1, self.parts)


@dataclass(frozen=True, eq=False)
class ColwiseGather(Style):
    """``colwise`` whose output is gathered again: what follows sees whole features (fused or
    interleaved projections, norms over the whole width)."""

    name = "colwise_gather"
    sequence_ready = True
    gathers = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _weighted(sch, path, self)
        column(sch, path)
        # its input gradient is this rank's part: all-reduced, or, under sequence parallelism,
        # reduce-scattered by the sequence gather at its parent's entry; whole features after it
        if not sequence_parallel:
            enter(sch, path)
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


@dataclass(frozen=True, eq=False)
class RowwiseSplit(Style):
    """``rowwise`` that takes this rank's slice of a whole input first."""

    name = "rowwise_split"
    sequence_ready = True
    scatters = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _weighted(sch, path, self)
        sch[path].sync(mode="fwd_pre", sync_op_or_fn="scatter", dim=-1)
        row(sch, path, sequence_parallel)


@dataclass(frozen=True, eq=False)
class ReplicatedGrad(Style):
    """Stays whole; its gradient is summed over the group (a norm over each attention head
    between the column and the row projections)."""

    name = "replicated_grad"
    sequence_ready = True
    keeps_whole = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        if any(True for _ in sch[path].mod.parameters(recurse=False)):  # a norm may have none
            replicated(sch, path)

    def apply_param(self, sch: Schedule, path: str) -> None:
        replicated(sch, path.rsplit(".", 1)[0])


@dataclass(frozen=True, eq=False)
class VocabEmbedding(Style):
    """An embedding split over the vocabulary; a head tied to it gathers its logits. A
    vocabulary that does not divide by the group stays whole."""

    name = "vocab_embedding"
    sequence_ready = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        mod = _embedding(sch, path, self, "rows")
        if mod.num_embeddings % tp_size(sch):
            return  # stays whole: right, only not split (the vocabulary does not divide)
        weight = mod.weight
        heads = [
            p
            for p, m in sch.mod.named_modules()
            if p != path
            and getattr(m, "weight", None) is weight
            and not isinstance(m, nn.Embedding)
        ]
        sch[path].shard("weight", axis=0)
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        for head in heads:  # a tied LM head now computes this rank's slice of the logits
            sch[head].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
            sch[head].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


@dataclass(frozen=True, eq=False)
class EmbeddingColwise(Style):
    """An embedding split over its features, gathered again."""

    name = "embedding_colwise"

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _embedding(sch, path, self, "features")
        sch[path].shard("weight", axis=1)
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


@dataclass(frozen=True, eq=False)
class RelativeBias(Style):
    """An embedding whose columns are attention heads (T5's relative position bias): split with
    the heads, not gathered; each rank's attention adds its own heads' bias."""

    name = "relative_bias"

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        _embedding(sch, path, self, "heads")
        sch[path].shard("weight", axis=1)


@dataclass(frozen=True, eq=False)
class Experts(Style):
    """A mixture of experts whose expert weights are split (by their own entries): its output
    is all-reduced, and so is the gradient of each of its inputs (the hidden states and the
    routing weights)."""

    name = "experts"

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        pass  # reduced once all its expert weights are split

    def apply_param(self, sch: Schedule, path: str) -> None:
        pass

    def reduced_as_experts(self, holds_row: bool) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class Reduced(Style):
    """Hugging Face's ``all_reduce`` of a module: its rowwise projection reduces it, or else it
    is reduced as experts."""

    name = "reduced"

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        pass

    def reduced_as_experts(self, holds_row: bool) -> bool:
        return not holds_row


@dataclass(frozen=True, eq=False)
class Local(Style):
    """A marker of Hugging Face's (``local_params``, ``replicate``): nothing to do."""

    name = "local"
    sequence_ready = True

    def apply(self, sch: Schedule, path: str, sequence_parallel: bool) -> None:
        pass

    def apply_param(self, sch: Schedule, path: str) -> None:
        pass


#: Hugging Face's ``base_model_tp_plan`` style names and the style each stands for.
HF_STYLES: dict[str, Style] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "packed_colwise": PackedColwise(),
    "colwise_gather_output": ColwiseGather(),
    "rowwise_split_input": RowwiseSplit(),
    "replicated_with_grad_allreduce": ReplicatedGrad(),
    "embedding_rowwise": VocabEmbedding(),
    "moe_tp_experts": Experts(),
    # DeepSeek's latent K/V projection stays whole and feeds the sharded heads
    "mla_kv_a_proj": ReplicatedGrad(),
    "packed_rowwise": PackedRowwise(),
    "embedding_colwise": EmbeddingColwise(),
    "all_reduce": Reduced(),
    # markers for Hugging Face's DTensor bookkeeping: the parameters stay as the entries say
    "local_params": Local(),
    "replicate": Local(),
}
