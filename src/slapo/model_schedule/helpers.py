"""The building blocks the family schedules are written with: one small function per idea.

Tensor parallelism follows Megatron-LM: q/k/v and the first MLP projection are column-parallel
(output features split), the attention output and the second MLP projection are row-parallel
(input features split, outputs all-reduced), and the input gradient of each parallel region is
all-reduced. A parameter that stays replicated inside a region but consumes its sharded
activations (a norm over each attention head) gets a partial gradient on each rank:
:func:`replicated` sums it over the group in backward. transformers 5 reshapes q/k/v with
``view(..., -1, head_dim)``, so sharded projections give each rank ``heads / world`` heads by
themselves; attributes that still hold the global sizes are divided with :func:`divide_attrs`
(GPT-2's ``split_size`` must be: it splits the fused q/k/v output).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..exceptions import SlapoError
from ..op import attention, register_transformers_attention
from ..random import recompute_dropout
from ..schedule import Schedule
from ..sharding import resolve_group
from ..sharding.rules import is_norm
from ..surgery import is_conv1d
from .fusion import install_fused_loss
from .knobs import Knobs

__all__ = [
    "blocks",
    "column",
    "row",
    "enter",
    "replicated",
    "per_head_norms",
    "divide_attrs",
    "tp_size",
    "checkpoint_blocks",
    "compile_blocks",
    "cut_stages",
    "stage_cuts",
    "use_attention",
    "apply_shared_knobs",
    "require",
]

# Megatron sequence parallelism: gather the sequence entering a TP region, reduce-scatter leaving.
SP_GATHER = {"sync_op_or_fn": "all_gather", "dim": 1, "bwd": "reduce_scatter"}


def blocks(sch: Schedule, *lists: str) -> list[str]:
    """The paths of every block of the given layer lists, in order.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> sch = slapo.create_schedule(gpt2)
        >>> blocks(sch, "transformer.h")
        ['transformer.h.0', 'transformer.h.1']
    """
    return [f"{path}.{name}" for path in lists for name in sch[path].child]


def column(sch: Schedule, path: str, fused: int = 1) -> None:
    """Column-parallel linear: split the output features (and the bias, if any)."""
    mod = sch[path].mod
    # transformers' Conv1D (GPT-2) stores its weight transposed (in x out); nn.Linear (out x in).
    sch[path].shard("weight", axis=1 if is_conv1d(mod) else 0, fused=fused)
    if getattr(mod, "bias", None) is not None:
        sch[path].shard("bias", axis=0, fused=fused)


def row(sch: Schedule, path: str, sequence_parallel: bool = False) -> None:
    """Row-parallel linear: split the input features; all-reduce (or reduce-scatter) the output."""
    sch[path].shard("weight", axis=0 if is_conv1d(sch[path].mod) else 1)
    if sequence_parallel:
        sch[path].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", dim=1)
    else:
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def enter(sch: Schedule, path: str, sequence_parallel: bool = False) -> None:
    """The start of a TP region: all-reduce the input gradient (or all-gather the sequence)."""
    if sequence_parallel:
        sch[path].sync(mode="fwd_pre", **SP_GATHER)
    else:
        sch[path].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def replicated(sch: Schedule, path: str) -> None:
    """A replicated module inside a TP region: its parameters stay whole on every rank but see
    only this rank's shard of the activations (e.g. a norm over each attention head, between the
    column-parallel q/k and the row-parallel output), so each rank's gradient is a partial sum;
    backward all-reduces it over the group (``sync(mode="bwd_param")``).

    Example:
        >>> import slapo, transformers
        >>> config = transformers.Qwen3Config(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32, head_dim=8,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> sch = slapo.create_schedule(transformers.Qwen3ForCausalLM(config))
        >>> env = slapo.env.setup(rank=0, world_size=1)  # sync needs a process group
        >>> replicated(sch, "model.layers.0.self_attn.q_norm")  # Qwen3
    """
    sch[path].sync(mode="bwd_param", sync_op_or_fn="all_reduce")


def per_head_norms(sch: Schedule, path: str) -> list[str]:
    """The paths of the norms inside attention module ``path`` that normalize one head at a time
    (Qwen3's ``q_norm``/``k_norm``): those with ``head_dim`` weights.

    Head-parallel attention shards whole heads, so such a norm keeps working per rank and only
    its gradient needs :func:`replicated`. A norm with another size normalizes across heads,
    which each rank holds only some of: a :class:`SlapoError` instead of wrong results.

    Example:
        >>> import slapo, transformers
        >>> config = transformers.Qwen3Config(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32, head_dim=8,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> sch = slapo.create_schedule(transformers.Qwen3ForCausalLM(config))
        >>> per_head_norms(sch, "model.layers.0.self_attn")  # Qwen3
        ['model.layers.0.self_attn.q_norm', 'model.layers.0.self_attn.k_norm']
    """
    attn = sch[path].mod
    config = getattr(sch.root.mod, "config", None)
    head_dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and config is not None:
        head_dim = config.hidden_size // config.num_attention_heads
    found = []
    for name, mod in attn.named_modules():
        weight = getattr(mod, "weight", None)
        norm_like = is_norm(mod) or "norm" in name.rsplit(".", 1)[-1].lower()
        if not name or not norm_like or not isinstance(weight, torch.Tensor):
            continue
        if weight.numel() != head_dim:
            raise SlapoError(
                f'tensor parallelism of "{path}": its norm "{name}" has {weight.numel()} '
                f"weights, not head_dim = {head_dim}: it normalizes across heads, which are split "
                "over the ranks; this plan supports norms over one head only"
            )
        found.append(f"{path}.{name}")
    return found


def tp_size(sch: Schedule) -> int:
    """The size of the schedule's tensor-parallel group."""
    return dist.get_world_size(resolve_group(sch.group))


def divide_attrs(sch: Schedule, path: str, *attrs: str) -> None:
    """Divide the global-size attributes of a sharded module by the TP size (heads, widths)."""
    mod, world = sch[path].mod, tp_size(sch)
    for attr in attrs:
        value = getattr(mod, attr)
        if value % world:
            raise SlapoError(
                f'tensor parallelism over {world} ranks: "{path}.{attr}" = {value} does not '
                f"divide by {world}; choose a group size that divides the heads"
            )
        setattr(mod, attr, value // world)


def checkpoint_blocks(
    sch: Schedule,
    paths: list[str],
    ratio: float,
    policy: str | None = None,
    recompute_dropout_in: Collection[str] = (),
) -> list[str]:
    """Checkpoint the first ``ceil(ratio * len(paths))`` blocks; returns their paths.

    ``policy``: a selective-checkpoint policy (``"save_matmuls"``, ...); None recomputes all.
    The blocks in ``recompute_dropout_in`` recompute their dropout instead of keeping it
    (``slapo.random.recompute_dropout``: an inductor bug around a kept dropout).
    """
    chosen = paths[: math.ceil(ratio * len(paths))]
    for path in chosen:
        # The primitive runs the block without its key/value cache while gradients are recorded
        # (a recompute would write it twice); the config is left alone, so generate() keeps it.
        if policy is not None and path in recompute_dropout_in:
            sch[path].checkpoint(policy=recompute_dropout(policy))
        else:
            sch[path].checkpoint(policy=policy)
    return chosen


def compile_blocks(sch: Schedule, paths: list[str], rng: str = "eager") -> None:
    """Compile each block (inductor) for training; eval and ``generate`` run it eagerly.

    Applied after sharding and checkpointing, so the compiler sees the local shapes and plans
    the recompute of a checkpointed block itself. Dropout draws its masks as ``rng`` says (the
    ``compile`` primitive's; ``"eager"``: the same masks as the unscheduled model).
    """
    for path in paths:
        sch[path].compile(grad_only=True, rng=rng)


def stage_cuts(paths: list[str], num_stages: int) -> list[str]:
    """The blocks after which ``num_stages`` pipeline stages of near-equal size end.

    Example:
        >>> stage_cuts([f"layers.{i}" for i in range(8)], 3)
        ['layers.2', 'layers.4']
    """
    if num_stages > len(paths):
        raise SlapoError(
            f"num_stages={num_stages} exceeds the {len(paths)} blocks of the model; a stage "
            "holds at least one block"
        )
    # Stage k ends after block round(n * (k + 1) / stages) - 1.
    return [paths[round(len(paths) * (k + 1) / num_stages) - 1] for k in range(num_stages - 1)]


def cut_stages(sch: Schedule, paths: list[str], num_stages: int) -> list[str]:
    """Cut the blocks into ``num_stages`` pipeline stages of near-equal size; returns the cuts."""
    cuts = stage_cuts(paths, num_stages)
    for path in cuts:
        sch[path].cut_pipeline_stage()
    return cuts


def apply_shared_knobs(
    sch: Schedule,
    k: Knobs,
    layers: list[str],
    head: str,
    shift: bool,
    recompute_dropout_in: Collection[str] = (),
) -> None:
    """Apply the knobs every family handles alike, after its own plan: the attention kernel,
    checkpointing of ``layers`` (selective with ``ckpt_policy``), their compilation, the fused
    loss from the hidden states at ``head`` (``shift``: next-token prediction), the pipeline
    cuts between ``layers``, and the compilation of the whole model. ``recompute_dropout_in``: see :func:`checkpoint_blocks`.

    Example:
        >>> import slapo, transformers
        >>> config = transformers.Qwen3Config(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32, head_dim=8,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> sch = slapo.create_schedule(transformers.Qwen3ForCausalLM(config))
        >>> from slapo.model_schedule.knobs import Knobs
        >>> knobs = Knobs(ckpt_ratio=1.0)
        >>> apply_shared_knobs(sch, knobs, blocks(sch, "model.layers"), "lm_head", shift=True)
    """
    use_attention(sch, k.attn_op)
    # Bulk masks are plain pointwise ops to inductor, clear of the mis-compiled kept dropout that
    # recompute_dropout_in works around; recomputed, they would be drawn in another order than
    # the eager model's (see slapo.primitives.compile_rng).
    if k.compile_rng == "bulk":
        recompute_dropout_in = ()
    checkpoint_blocks(sch, layers, k.ckpt_ratio, k.selective_policy, recompute_dropout_in)
    if k.compile_blocks:
        compile_blocks(sch, layers, k.compile_rng)
    if k.fused_loss:
        install_fused_loss(sch, head, shift=shift)
    cut_stages(sch, layers, k.num_stages)
    if k.compile_model:
        # last: the region holds every primitive applied above
        sch.compile(grad_only=True, rng=k.compile_rng)


def use_attention(sch: Schedule, attn_op: str | None) -> int:
    """Route every attention module of a transformers model through ``slapo.op.attention``.

    The kernel is registered with transformers' ``AttentionInterface`` as ``"slapo"`` and each
    attention module carries its choice (``slapo_attention_impl``). Returns the modules switched.
    """
    if attn_op is None:
        return 0
    model = sch.mod
    config = getattr(model, "config", None)
    if config is None:
        raise SlapoError(f"attn_op={attn_op!r} needs a transformers model (with .config)")
    if any(hasattr(m, "has_relative_attention_bias") for m in model.modules()):
        # T5 hands its relative position bias over as position_bias=, apart from the mask.
        # deferred: transformers takes seconds to import; only T5 schedules need it here.
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        name = "slapo_position_bias"
        AttentionInterface.register(name, _attention_with_position_bias)
        AttentionMaskInterface.register(name, eager_mask)  # explicit (causal) masks, as eager
    else:
        name = register_transformers_attention()
    switched = 0
    for mod in model.modules():
        if getattr(mod, "config", config) is not config and hasattr(mod, "config"):
            mod.config._attn_implementation = name  # sub-configs (e.g. a T5 stack's copy)
        if type(mod).__name__.endswith(("Attention", "SelfAttention")) and _calls_interface(mod):
            mod.slapo_attention_impl = attn_op
            switched += 1
    if not switched:
        raise SlapoError(
            f"attn_op={attn_op!r}: no attention module of {type(model).__name__} uses "
            "transformers' AttentionInterface, so the kernel cannot be switched"
        )
    config._attn_implementation = name
    return switched


def _attention_with_position_bias(
    module: nn.Module,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention signature; the position bias joins the additive mask."""
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    if mask is not None and mask.dtype == torch.bool:  # masking_utils may give a boolean mask
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )
    if position_bias is not None:
        mask = position_bias if mask is None else position_bias + mask
    impl = getattr(module, "slapo_attention_impl", "auto")
    out = attention(query, key, value, mask, dropout, False, scaling, impl)
    return out.transpose(1, 2).contiguous(), None


def _calls_interface(mod: nn.Module) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(mod).forward)
    except (OSError, TypeError):
        return False


def require(condition: bool, message: str) -> None:
    """Raise a :class:`SlapoError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise SlapoError(message)
