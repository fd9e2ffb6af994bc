"""Per-layer shard rules: what else changes when a parameter of a known layer type is sharded.

A rule keeps the module consistent with its new, smaller parameter: it updates the shape
attributes (``out_features``, ``nf``, ``num_embeddings``, ...) and, where the math requires it,
changes how the module runs:

* input-axis ("row-parallel") sharding of a layer with a bias: each rank computes a partial sum, so
  the bias must be added once, *after* the ``fwd_post`` sync sums the partials. The module runs
  without its bias and ``sync`` adds it (see ``apply_after_sync``); the bias stays replicated and
  its gradient is the full one on every rank.
* vocabulary ("row") sharding of an embedding: ids outside this rank's rows give zeros, so a
  ``fwd_post`` all-reduce rebuilds the full lookup.
* channel sharding of a BatchNorm (or an InstanceNorm with running statistics): each channel is
  normalized by its own statistics, so the math needs no change, but the running mean and
  variance buffers are cut to the same channels (they carry the ``ShardSpec`` too).

Modules of other types are sharded as given, with no attribute changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import PrimitiveError
from ..surgery import forward_wraps, is_conv1d, wrap_forward
from .spec import SPEC_ATTR, ShardSpec, get_shard_spec

__all__ = ["apply_rule", "apply_after_sync", "is_norm", "ORIG_ATTRS"]

# Original values of the attributes a rule changed, kept for consolidation (which initializes the
# module at full size) and for export.
ORIG_ATTRS = "_slapo_orig_attrs"
_AFTER_SYNC = "_slapo_after_sync"

Rule = Callable[[nn.Module, str, ShardSpec, str], None]


def _set_attrs(mod: nn.Module, **values: Any) -> None:
    orig = mod.__dict__.setdefault(ORIG_ATTRS, {})
    for name, value in values.items():
        orig.setdefault(name, getattr(mod, name))
        setattr(mod, name, value)


def _local(spec: ShardSpec) -> int:
    return spec.padded // spec.world


def _bad_axis(mod: nn.Module, name: str, spec: ShardSpec, path: str, allowed: str) -> None:
    raise PrimitiveError(
        f'shard on "{path}" ({type(mod).__name__}): axis {spec.axis} of "{name}" cannot be '
        f"sharded; {allowed}"
    )


# ----- row-parallel bias -----------------------------------------------------------------------
def _bias_last(mod: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return out + mod.bias


def _bias_channels(mod: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return out + mod.bias.view(1, -1, *([1] * (out.dim() - 2)))


def apply_after_sync(mod: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Finish a row-parallel module's output after its ``fwd_post`` sync (adds the bias)."""
    post = mod.__dict__.get(_AFTER_SYNC)
    return out if post is None else post(mod, out)


def _linear_no_bias(forward: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return F.linear(x, forward.__self__.weight)


def _conv1d_no_bias(forward: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    mod = forward.__self__
    out = x.reshape(-1, x.size(-1)) @ mod.weight
    return out.view(*x.shape[:-1], mod.weight.shape[1])


def _convnd_no_bias(forward: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    mod = forward.__self__
    return mod._conv_forward(x, mod.weight, None)


def _defer_bias(mod: nn.Module, no_bias_forward: Any, after: Any) -> None:
    if getattr(mod, "bias", None) is None or "shard_row_parallel" in forward_wraps(mod):
        return
    wrap_forward(mod, "shard_row_parallel", no_bias_forward)
    mod.__dict__[_AFTER_SYNC] = after


# ----- vocabulary-parallel embedding ---------------------------------------------------------
def _vocab_parallel(forward: Any, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    start, end = forward.__self__._slapo_vocab_range
    outside = (ids < start) | (ids >= end)
    out = forward((ids - start).masked_fill(outside, 0), *args, **kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


# ----- rules -----------------------------------------------------------------------------------
def _linear(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    if name == "weight" and spec.axis == 0:
        _set_attrs(mod, out_features=_local(spec))
    elif name == "weight" and spec.axis == 1:
        _set_attrs(mod, in_features=_local(spec))
        _defer_bias(mod, _linear_no_bias, _bias_last)


def _conv1d(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    # transformers' Conv1D stores the weight as (in=nx, out=nf).
    if name == "weight" and spec.axis == 1:
        _set_attrs(mod, nf=_local(spec))
    elif name == "weight" and spec.axis == 0:
        _set_attrs(mod, nx=_local(spec))
        _defer_bias(mod, _conv1d_no_bias, _bias_last)
    elif name == "bias":
        _set_attrs(mod, nf=_local(spec))


def _embedding(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    if spec.axis == 1:
        _set_attrs(mod, embedding_dim=_local(spec))
        return
    start, end = spec.local_range
    pad = mod.padding_idx
    _set_attrs(
        mod,
        num_embeddings=_local(spec),
        padding_idx=pad - start if pad is not None and start <= pad < end else None,
    )
    mod._slapo_vocab_range = (start, end)
    if "vocab_parallel" not in forward_wraps(mod):
        wrap_forward(mod, "vocab_parallel", _vocab_parallel)


def _convnd(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    if mod.groups != 1:
        raise PrimitiveError(
            f'shard on "{path}": grouped convolutions (groups={mod.groups}) are not supported'
        )
    if name == "weight" and spec.axis == 0:
        _set_attrs(mod, out_channels=_local(spec))
    elif name == "weight" and spec.axis == 1:
        _set_attrs(mod, in_channels=_local(spec))
        _defer_bias(mod, _convnd_no_bias, _bias_channels)
    elif name == "weight":
        _bad_axis(mod, name, spec, path, "shard the output (0) or input (1) channels")


def _norm(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    # A norm over a sharded hidden dimension only normalizes its slice: right for per-head norms,
    # and the caller's responsibility otherwise.
    shape = getattr(mod, "normalized_shape", None)
    if isinstance(shape, tuple) and len(shape) == 1:
        _set_attrs(mod, normalized_shape=(_local(spec),))
    elif hasattr(mod, "hidden_size") and isinstance(mod.hidden_size, int):
        _set_attrs(mod, hidden_size=_local(spec))


def _batchnorm(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    if spec.axis != 0:
        _bad_axis(mod, name, spec, path, "shard the channels (axis 0)")
    _set_attrs(mod, num_features=_local(spec))
    # The weight and the bias are sharded one after the other: the buffers are cut once.
    for buf in ("running_mean", "running_var"):
        full = mod._buffers.get(buf)
        if full is None or get_shard_spec(full) is not None:
            continue
        if tuple(full.shape) != spec.full_shape:
            raise PrimitiveError(
                f'shard on "{path}" ({type(mod).__name__}): the buffer "{buf}" has shape '
                f'{tuple(full.shape)}, not that of "{name}" {spec.full_shape}'
            )
        with torch.no_grad():
            local = spec.local_slice(full)
        setattr(local, SPEC_ATTR, spec)
        mod._buffers[buf] = local


def _fused_qkv(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    # slapo.op.FusedQKV lays its rows out rank by rank: contiguous output-axis shards over the
    # group it was laid out for are whole heads of q, k and v; anything else would mix them.
    if spec.axis != 0:
        _bad_axis(mod, name, spec, path, "shard the output rows (axis 0) of a FusedQKV")
    if spec.fused != 1 or spec.padded != spec.full_shape[0] or spec.world != mod.world_size:
        raise PrimitiveError(
            f'shard on "{path}" (FusedQKV): its rows are laid out for {mod.world_size} rank(s) '
            f"(world_size={mod.world_size}) but the shard is over {spec.world} rank(s)"
            f"{' with fused/pad' if spec.fused != 1 or spec.padded != spec.full_shape[0] else ''}"
            f"; build it with FusedQKV(..., world_size={spec.world}) (or from_linears(..., "
            f"world_size={spec.world})) and shard with the default fused=1, pad=False"
        )
    if name == "weight":
        _set_attrs(mod, out_features=_local(spec))


def is_norm(mod: nn.Module) -> bool:
    """Whether ``mod`` is a norm layer (torch's, or a class named ...RMSNorm or ...LayerNorm)."""
    norm_types = (nn.LayerNorm, nn.RMSNorm)
    return isinstance(mod, norm_types) or type(mod).__name__.endswith(("RMSNorm", "LayerNorm"))


def find_rule(mod: nn.Module) -> Rule | None:
    """The shard rule of ``mod``'s layer type, or None for a module without one."""
    if isinstance(mod, nn.Linear):
        return _linear
    from ..op.linear import FusedQKV  # deferred: slapo.op imports much of slapo

    if isinstance(mod, FusedQKV):
        return _fused_qkv
    if isinstance(mod, nn.Embedding):
        return _embedding
    if isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed:
        return _convnd
    if is_conv1d(mod):
        return _conv1d
    if is_norm(mod):
        return _norm
    if isinstance(mod, nn.modules.batchnorm._NormBase):  # BatchNorm*d, SyncBatchNorm, InstanceNorm
        return _batchnorm
    return None


def apply_rule(mod: nn.Module, name: str, spec: ShardSpec, path: str) -> None:
    """Update ``mod`` after its parameter ``name`` was sharded as ``spec``."""
    rule = find_rule(mod)
    if rule is not None:
        rule(mod, name, spec, path)
