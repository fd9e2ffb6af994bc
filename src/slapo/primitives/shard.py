"""``shard``: keep only this rank's slice of a parameter (tensor parallelism)."""

from __future__ import annotations

import torch
from torch import nn

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..sharding import groups
from ..sharding.rules import apply_rule
from ..sharding.spec import SPEC_ATTR, ShardSpec, get_shard_spec
from ..surgery import join_path, label


@register_primitive()
class ShardPrimitive(Primitive):
    """Shard parameter ``param_name`` of this module along ``axis`` over the schedule's group.

    Each rank keeps its contiguous slice; the original (unsharded, unpadded) shape is recorded on
    the parameter, as ``param.orig_shape`` (a ``torch.Size``, as Slapo code reads it) and in its
    layout (``slapo.sharding.get_shard_spec(param).full_shape``). Known layers follow: ``nn.Linear``
    (``out_features``/``in_features``), transformers' ``Conv1D`` (``nf``/``nx``), ``nn.Embedding``
    (axis 0 makes it vocabulary-parallel), ``nn.Conv2d`` (channels) and norms (a BatchNorm's
    running statistics are cut to its channels too). Input-axis sharding
    of a layer with a bias adds the bias after the layer's ``fwd_post`` sync. A parameter tied to
    other modules is sharded once, for all of them, and stays tied.

    Args:
        param_name: a parameter of this very module, e.g. ``"weight"``.
        axis: the axis to shard (negative counts from the end).
        pad: pad the axis with zeros up to a multiple of the group size instead of raising (for a
            vocabulary that does not divide; pair it with ``vocab_parallel_cross_entropy``).
        fused: the number of equal blocks concatenated along ``axis`` (3 for a fused q/k/v
            projection); each block is sharded on its own.

    Example:
        >>> import slapo
        >>> from torch import nn
        >>> env = slapo.env.setup(rank=0, world_size=1)  # 2 ranks under torchrun shard in halves
        >>> model = nn.Sequential()
        >>> model.fc1, model.act, model.fc2 = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)
        >>> sch = slapo.create_schedule(model)
        >>> sch["fc1"].shard("weight", axis=0); sch["fc1"].shard("bias", axis=0)
        >>> sch["fc2"].shard("weight", axis=1)
        >>> sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        >>> sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    """

    name = "shard"

    @staticmethod
    def apply(sch: Schedule, param_name: str, axis: int, pad: bool = False, fused: int = 1) -> None:
        path = label(sch.path)
        param = _own_param(sch, param_name)
        if get_shard_spec(param) is not None:
            raise PrimitiveError(f'shard on "{path}": "{param_name}" is already sharded')
        if not isinstance(axis, int) or not -param.dim() <= axis < param.dim():
            raise PrimitiveError(
                f'shard on "{path}": axis {axis!r} is out of range for "{param_name}" of shape '
                f"{tuple(param.shape)} ({param.dim()} dimensions)"
            )
        axis %= param.dim()
        groups.require_initialized(path)
        group = groups.resolve_group(sch.group, path)
        spec = _make_spec(path, param_name, param, axis, group, pad, fused)

        new = nn.Parameter(_local_tensor(param, spec), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        setattr(new, SPEC_ATTR, spec)
        new.orig_shape = torch.Size(param.shape)
        holders = _holders(sch.root.mod, param)
        for holder_path, holder, attr in holders:
            holder._parameters[attr] = new
            apply_rule(holder, attr, spec, label(holder_path))
        if len(holders) > 1:
            sch.metadata.tie_weights[new] = new


def _own_param(sch: Schedule, name: str) -> nn.Parameter:
    params = dict(sch.mod.named_parameters(recurse=False))
    if name in params:
        return params[name]
    path = label(sch.path)
    nested = [n for n, _ in sch.mod.named_parameters() if n.rsplit(".", 1)[-1] == name]
    hint = ""
    if nested:
        owner = nested[0].rsplit(".", 1)[0]
        hint = f' Did you mean sch["{join_path(sch.path, owner)}"].shard("{name}", ...)?'
    raise PrimitiveError(
        f'shard: "{path}" ({type(sch.mod).__name__}) has no parameter "{name}"; its own '
        f"parameters are: {', '.join(params) or '(none)'}.{hint}"
    )


def _make_spec(
    path: str,
    name: str,
    param: torch.Tensor,
    axis: int,
    group: object,
    pad: bool,
    fused: int,
) -> ShardSpec:
    world = groups.group_size(group)  # type: ignore[arg-type]
    rank = groups.group_rank(group, path)  # type: ignore[arg-type]
    size = param.shape[axis]
    if not isinstance(fused, int) or fused < 1 or size % fused:
        raise PrimitiveError(
            f'shard on "{path}": fused={fused!r} must be a positive integer dividing the size '
            f'{size} of axis {axis} of "{name}"'
        )
    if fused > 1 and pad:
        raise PrimitiveError(f'shard on "{path}": pad=True and fused > 1 cannot be combined')
    block = size // fused
    if block % world and not pad:
        what = f"each of the {fused} fused blocks of size {block}" if fused > 1 else f"size {size}"
        raise PrimitiveError(
            f'shard on "{path}": axis {axis} of "{name}" (shape {tuple(param.shape)}) has {what}, '
            f"which does not divide by the group size {world}; pass pad=True to pad it with zeros "
            "(vocabularies), or choose a group size that divides it"
        )
    padded = -(-size // world) * world if pad else size
    return ShardSpec(axis, world, rank, tuple(param.shape), padded, fused, group)


def _local_tensor(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    if param.is_meta:
        return torch.empty(spec.local_shape, dtype=param.dtype, device="meta")
    with torch.no_grad():
        return spec.local_slice(param.detach())


def _holders(root: nn.Module, param: nn.Parameter) -> list[tuple[str, nn.Module, str]]:
    """Every (path, module, attribute) that holds ``param``: tied modules share one parameter."""
    found = []
    for mod_path, mod in root.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is param:
                found.append((mod_path, mod, attr))
    # A module reached twice (remove_duplicate=False) is updated once.
    seen: set[tuple[int, str]] = set()
    unique = []
    for mod_path, mod, attr in found:
        if (id(mod), attr) not in seen:
            seen.add((id(mod), attr))
            unique.append((mod_path, mod, attr))
    return unique
