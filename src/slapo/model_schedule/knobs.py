"""The knobs of a ready schedule, checked once so that every family reads them as plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import SlapoError
from ..primitives.compile_rng import RNG_MODES
from ..sharding import resolve_group

__all__ = [
    "Knobs",
    "ATTN_OPS",
    "CKPT_POLICIES",
    "CPU_DEFAULTS",
    "LAYOUT_KNOBS",
    "recommended_knobs",
]

ATTN_OPS = ("eager", "sdpa", "flash")
#: ``ckpt_policy`` values: "full" recomputes the whole block; the others are selective
#: (``slapo.random.CHECKPOINT_POLICIES``): "save_matmuls" keeps the linear layers' and attention
#: kernels' outputs and recomputes the cheap elementwise, norm and dropout ops;
#: "save_narrow_matmuls" also recomputes the widening linear layers (MLP up/gate);
#: "save_attention" recomputes every linear layer.
CKPT_POLICIES = ("full", "save_matmuls", "save_narrow_matmuls", "save_attention")
#: The knobs that say how the model is laid out over devices, not how it is optimized: given
#: alone to ``apply_schedule``, the recommended optimization knobs still apply.
LAYOUT_KNOBS = ("group", "sequence_parallel", "num_stages")


@dataclass(frozen=True)
class Knobs:
    """The options of :func:`slapo.model_schedule.apply_schedule`, validated.

    Attributes:
        group: tensor parallelism over this ProcessGroup or 1-D DeviceMesh; None: no TP.
        sequence_parallel: shard the activations between TP regions over the sequence.
        ckpt_ratio: fraction of the blocks checkpointed (the first ones), in [0, 1].
        ckpt_policy: how a checkpointed block recomputes: "full" (everything; also None),
            "save_matmuls", "save_narrow_matmuls" or "save_attention" (selective; see
            :data:`CKPT_POLICIES`).
        compile_blocks: compile every block with inductor (after sharding and checkpointing;
            eval and ``generate`` run eagerly), so that its elementwise ops fuse and a selective
            checkpoint costs no dispatch overhead.
        compile_model: compile the whole model as one region (inductor; eval and ``generate``
            run eagerly): the blocks (their checkpoints compiled in) and what surrounds them,
            embeddings, masks, final norm, head and loss. The fastest on CPU; needs
            ``num_stages=1``. With ``compile_blocks`` too, the blocks are compiled inside it.
        compile_rng: where the compiled regions' dropout draws its masks: ``"eager"`` (torch's
            generator op by op: the unscheduled model's masks), ``"bulk"`` (four decisions per
            64-bit draw, about 4x cheaper on CPU; :func:`slapo.op.dropout.bulk_dropout`) or
            ``"inductor"`` (see the ``compile`` primitive).
        attn_op: the attention kernel ("eager", "sdpa", "flash" on CUDA); None keeps the model's.
        fuse_ops: fuse bias+GELU and bias+dropout+residual where the family has them.
        fused_loss: chunked LM head + cross-entropy (the full logits never exist).
        num_stages: pipeline stages (cuts between blocks, for the "pipeline" target).

    Example:
        >>> Knobs(ckpt_ratio=0.5).ckpt_ratio
        0.5
    """

    group: Any = None
    sequence_parallel: bool = False
    ckpt_ratio: float = 0.0
    ckpt_policy: str | None = None
    compile_blocks: bool = False
    compile_model: bool = False
    compile_rng: str = "eager"
    attn_op: str | None = None
    fuse_ops: bool = False
    fused_loss: bool = False
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in (
            "sequence_parallel",
            "fuse_ops",
            "fused_loss",
            "compile_blocks",
            "compile_model",
        ):
            if not isinstance(getattr(self, name), bool):
                raise SlapoError(f"{name} must be True or False, got {getattr(self, name)!r}")
        ratio = self.ckpt_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise SlapoError(f"ckpt_ratio must be a number in [0, 1], got {ratio!r}")
        if self.ckpt_policy is not None and self.ckpt_policy not in CKPT_POLICIES:
            raise SlapoError(
                f"ckpt_policy must be one of {CKPT_POLICIES} or None, got {self.ckpt_policy!r}"
            )
        if self.compile_rng not in RNG_MODES:
            raise SlapoError(f"compile_rng must be one of {RNG_MODES}, got {self.compile_rng!r}")
        if self.attn_op is not None and self.attn_op not in ATTN_OPS:
            raise SlapoError(f"attn_op must be one of {ATTN_OPS} or None, got {self.attn_op!r}")
        if self.attn_op == "flash" and not torch.cuda.is_available():
            raise SlapoError("attn_op='flash' needs CUDA; use attn_op='sdpa' on CPU")
        stages = self.num_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise SlapoError(f"num_stages must be a positive int, got {stages!r}")
        if self.compile_model and stages > 1:
            raise SlapoError(
                "compile_model=True compiles the whole model as one region, which pipeline "
                "stages split; with num_stages > 1 use compile_blocks=True"
            )
        if self.sequence_parallel and self.group is None:
            raise SlapoError(
                "sequence_parallel=True needs tensor parallelism: pass group= (a ProcessGroup or "
                "a 1-D DeviceMesh) too"
            )

    @property
    def tensor_parallel(self) -> bool:
        return self.group is not None

    @property
    def selective_policy(self) -> str | None:
        """The selective-checkpoint policy of checkpointed blocks; None: full recompute."""
        return None if self.ckpt_policy in (None, "full") else self.ckpt_policy

    def as_dict(self) -> dict[str, Any]:
        """The knobs as a dict (the group as its size), for logs and ``sch.extra``."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["group"] = None if self.group is None else _describe(self.group)
        return out


def _describe(group: Any) -> str:
    pg = resolve_group(group)
    return f"tp{dist.get_world_size(pg)}"


#: The best measured combination of knobs for training on CPU, per family: the fastest schedule
#: at 0.7x the unscheduled model's peak memory or less (``benchmarks/model_schedules.py
#: --isolate 2`` and ``3``, each schedule alone in its process, 2 cores). Every family compiles the whole
#: model, draws its dropout masks in bulk (``compile_rng="bulk"``: dropout's ``bernoulli_`` was a
#: quarter to a third of a compiled step) and uses SDPA attention. GPT-2 needs no checkpoint (the
#: compiled model alone keeps 0.69x the memory); the others checkpoint their blocks selectively:
#: Llama three blocks of four (all four cost 4% more time for 0.05x less memory), OPT (whose state
#: is a larger part of its peak) recomputing its MLP's widening projection too and computing the
#: loss in chunks, T5 three blocks of four like Llama (at the same speed as half of them, 0.64x
#: the memory instead of 0.70x).
_COMPILED = {"compile_model": True, "compile_rng": "bulk", "attn_op": "sdpa"}
_SELECTIVE = {"ckpt_ratio": 1.0, "ckpt_policy": "save_matmuls", **_COMPILED}
CPU_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_SELECTIVE, "ckpt_ratio": 0.75},
    "gpt2": _COMPILED,
    "bert": _SELECTIVE,
    "opt": {**_SELECTIVE, "ckpt_policy": "save_narrow_matmuls", "fused_loss": True},
    "t5": {**_SELECTIVE, "ckpt_ratio": 0.75},
    # not measured yet: half of the blocks fully recomputed, as the generic plan does
    "wideresnet": {"ckpt_ratio": 0.5},
}


def recommended_knobs(family: str, **overrides: Any) -> dict[str, Any]:
    """The knobs of ``family``'s best measured schedule for CPU training, with ``overrides``.

    A family without a measured entry gets the llama one (the plans share their knobs).

    Example:
        >>> from slapo.model_schedule import apply_schedule
        >>> recommended_knobs("llama")["ckpt_policy"]
        'save_matmuls'
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> sch = apply_schedule(model, **recommended_knobs("gpt2", ckpt_ratio=0.5))
    """
    return {**CPU_DEFAULTS.get(family, CPU_DEFAULTS["llama"]), **overrides}
