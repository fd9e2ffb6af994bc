"""``consolidate_model``: make a sharded meta-device model real, each shard initialized as a slice
of the model one process would have initialized with the same seed.

Initialization draws random numbers for the *full* tensor, so a shard cannot be initialized on its
own and still match. Each sharded parameter is therefore given its full shape (and its module its
original attributes), initialized exactly as :func:`slapo.initialization.materialize_module` would,
then cut to this rank's slice. With ``param_init_fn`` this streams module by module, so at most one
module's (and its tied partners') full tensors exist at a time; without it the model's own
initialization (Hugging Face ``init_weights``) runs once on the full-shape model, then every
parameter is cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .exceptions import SlapoError
from .initialization import materialize_module
from .schedule import Schedule
from .sharding.rules import ORIG_ATTRS
from .sharding.spec import SPEC_ATTR, ShardSpec, get_shard_spec

__all__ = ["consolidate_model"]

_TARGETS = (None, "eager", "ddp", "fsdp", "pipeline", "roundpipe", "deepspeed")


def consolidate_model(
    sch: Schedule,
    target: str | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Materialize and initialize the scheduled (sharded, meta-device) model; returns it.

    Args:
        sch: the root schedule, after ``shard``; its model was built under
            ``slapo.init_empty_weights()``.
        target: the build target the model is for; tensor-parallel consolidation is the same for
            every target.
        param_init_fn: ``fn(module)`` that initializes a module's parameters in place (called on
            full-size parameters); None uses the model's own initialization.

    Example:
        >>> import slapo, torch, transformers
        >>> env = slapo.env.setup(rank=0, world_size=1)  # shard needs a process group
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)
        >>> with slapo.init_empty_weights():
        ...     model = transformers.GPT2LMHeadModel(config)
        >>> sch = slapo.create_schedule(model)
        >>> sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)  # ... the whole plan
        >>> def init_fn(module):
        ...     for param in module.parameters(recurse=False):
        ...         torch.nn.init.normal_(param, std=0.02)
        >>> _ = torch.manual_seed(0)
        >>> model = slapo.consolidate_model(sch, param_init_fn=init_fn)
        >>> model.transformer.h[0].mlp.c_fc.weight.device
        device(type='cpu')
    """
    if not isinstance(sch, Schedule):
        raise SlapoError(f"consolidate_model needs a Schedule, got {type(sch).__name__}")
    if target not in _TARGETS:
        raise SlapoError(f"consolidate_model: unsupported target {target!r}; use one of {_TARGETS}")
    if kwargs:
        raise SlapoError(f"consolidate_model: unexpected arguments {sorted(kwargs)}")
    model = sch.root.mod
    if param_init_fn is None:
        _whole_model(model)
    else:
        _streaming(model, param_init_fn)
    return model


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((mod, attr))
    return found


def _new_param(like: nn.Parameter, data: torch.Tensor, spec: ShardSpec | None) -> nn.Parameter:
    new = nn.Parameter(data, requires_grad=like.requires_grad)
    new.__dict__.update(like.__dict__)
    new.__dict__.pop("_is_hf_initialized", None)
    if spec is None:
        new.__dict__.pop(SPEC_ATTR, None)
    else:
        setattr(new, SPEC_ATTR, spec)
    return new


@contextlib.contextmanager
def _full_attrs(mods: list[nn.Module]) -> Iterator[None]:
    """Give modules their pre-shard attributes (shapes, padding_idx) for the duration."""
    saved = []
    for mod in mods:
        orig = mod.__dict__.get(ORIG_ATTRS, {})
        saved.append((mod, {k: getattr(mod, k) for k in orig}))
        for k, v in orig.items():
            setattr(mod, k, v)
    try:
        yield
    finally:
        for mod, local in saved:
            for k, v in local.items():
                setattr(mod, k, v)


def _set(holders: list[tuple[nn.Module, str]], param: nn.Parameter) -> None:
    for mod, attr in holders:
        mod._parameters[attr] = param


def _whole_model(model: nn.Module) -> None:
    holders = _holders(model)
    full: list[tuple[nn.Parameter, ShardSpec, list[tuple[nn.Module, str]]]] = []
    for held in holders.values():
        param = held[0][0]._parameters[held[0][1]]
        spec = get_shard_spec(param)
        if spec is None or not param.is_meta:
            continue
        big = _new_param(
            param, torch.empty(spec.full_shape, dtype=param.dtype, device="meta"), None
        )
        _set(held, big)
        full.append((big, spec, held))
    with _full_attrs([m for *_, held in full for m, _ in held]):
        materialize_module(model)
    for _, spec, held in full:
        real = held[0][0]._parameters[held[0][1]]  # materialize_module made a new parameter
        with torch.no_grad():
            _set(held, _new_param(real, spec.local_slice(real.detach()), spec))


def _streaming(model: nn.Module, init_fn: Callable[[nn.Module], None]) -> None:
    holders = _holders(model)
    touched = [
        m
        for m in model.modules()
        if any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()])
    ]
    remaining = {key: sum(m in touched for m, _ in held) for key, held in holders.items()}
    # The meta parameter each real full one replaces, to find its spec and holders again.
    origin: dict[int, tuple[int, ShardSpec | None]] = {}
    for mod in touched:
        for p in list(mod._parameters.values()):
            if p is None or not p.is_meta:
                continue
            spec = get_shard_spec(p)
            shape = spec.full_shape if spec is not None else p.shape
            real = _new_param(p, torch.empty(shape, dtype=p.dtype), None)
            origin[id(real)] = (id(p), spec)
            _set(holders[id(p)], real)
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device="cpu")
        with _full_attrs([mod]), torch.no_grad():
            init_fn(mod)
        for p in list(mod._parameters.values()):
            if p is None or id(p) not in origin:
                continue
            key, spec = origin[id(p)]
            remaining[key] -= 1
            if remaining[key] == 0:
                del origin[id(p)]
                if spec is not None:
                    with torch.no_grad():
                        _set(holders[key], _new_param(p, spec.local_slice(p.detach()), spec))
