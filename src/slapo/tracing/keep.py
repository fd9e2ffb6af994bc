"""What a traced module keeps of the original beyond its graph: every parameter and buffer (also
those the captured call did not use, such as a decoder layer's cross-attention when traced on a
decoder-only call) and the plain attributes its parent may read (``attention_type``, ``config``).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx, nn

__all__ = ["keep_attributes", "keep_state"]


def keep_state(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` every parameter and buffer of ``old`` it lacks, under the same name and as
    the same object: a missing submodule is the original one, put back whole.

    Example:
        >>> old = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> new = nn.Sequential(nn.Linear(2, 2))
        >>> keep_state(new, old)
        >>> new[1] is old[1]
        True
    """
    have = {n for n, _ in new.named_parameters(remove_duplicate=False)}
    have |= {n for n, _ in new.named_buffers(remove_duplicate=False)}
    state = [
        *old.named_parameters(remove_duplicate=False),
        *old.named_buffers(remove_duplicate=False),
    ]
    for name, _ in state:
        if name not in have:
            _put_back(new, old, name)
            have |= {n for n, _ in new.named_parameters(remove_duplicate=False)}
            have |= {n for n, _ in new.named_buffers(remove_duplicate=False)}


def _put_back(new: nn.Module, old: nn.Module, name: str) -> None:
    """Put the parameter or buffer ``name`` of ``old`` into ``new`` at the same path."""
    *owners, attr = name.split(".")
    new_owner, old_owner = new, old
    for part in owners:
        old_owner = getattr(old_owner, part)
        child = new_owner._modules.get(part)
        if child is None:  # the whole submodule is missing: the original one, as it is
            new_owner.add_module(part, old_owner)
            return
        new_owner = child
    if attr in old_owner._parameters:
        new_owner.register_parameter(attr, old_owner._parameters[attr])
    else:
        persistent = attr not in old_owner._non_persistent_buffers_set
        new_owner.register_buffer(attr, old_owner._buffers[attr], persistent=persistent)


def keep_attributes(new: nn.Module, old: nn.Module) -> None:
    """Copy the plain attributes of each original module onto its traced ``GraphModule`` (the
    ones it lacks): callers read them (``layer.attention_type``, ``layer.layer_idx``). Those of
    the instance and those its model class sets in the class body (``attention_type = ...``).

    Example:
        >>> old = nn.Linear(2, 2)
        >>> old.block_type = "attention"
        >>> new = fx.symbolic_trace(old)
        >>> keep_attributes(new, old)
        >>> new.block_type, new.in_features
        ('attention', 2)
    """
    olds = dict(old.named_modules(remove_duplicate=False))
    for name, sub in new.named_modules(remove_duplicate=False):
        orig = olds.get(name)
        if orig is None or orig is sub or not isinstance(sub, fx.GraphModule):
            continue
        taken = set(dir(type(sub)))
        for key, value in _plain_attributes(orig).items():
            if key not in sub.__dict__ and key not in taken:
                sub.__dict__[key] = value


def _plain_attributes(mod: nn.Module) -> dict[str, Any]:
    """``mod``'s data attributes: its class bodies' (below nn.Module), then its own."""
    found: dict[str, Any] = {}
    for cls in reversed(type(mod).__mro__):
        if issubclass(nn.Module, cls):  # nn.Module and its bases: torch's, not the model's
            continue
        for key, value in vars(cls).items():
            if not key.startswith("__") and _is_data(value):
                found[key] = value
    skip = ("forward", "_slapo_retrace")  # a traced module's own (retrace.py)
    found.update((k, v) for k, v in vars(mod).items() if k not in skip and _is_data(v))
    return found


def _is_data(value: Any) -> bool:
    """Not a method, property or descriptor, module or parameter: a value callers read."""
    if isinstance(value, nn.Module | nn.Parameter | property | staticmethod | classmethod):
        return False
    return not inspect.isfunction(value) and not hasattr(type(value), "__get__")
