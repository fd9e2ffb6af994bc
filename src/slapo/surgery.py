"""Module surgery with no knowledge of schedules: the floor every other slapo layer stands on.

Class-swap forward wrapping (which keeps the forward's signature), moving hooks between
modules, putting a module at a dotted path, fresh attribute names, path joining and labels, and
the transformers ``Conv1D`` test. This module imports nothing from slapo, so any layer may use
it.

Example:
    >>> from torch import nn
    >>> from slapo.surgery import join_path, label, set_submodule
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> set_submodule(model, "1", nn.GELU())
    >>> join_path("", "1"), join_path("encoder", "1"), label("")
    ('1', 'encoder.1', '<root>')
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "ForwardWrapper",
    "carry_signature",
    "forward_wraps",
    "is_conv1d",
    "join_path",
    "label",
    "move_hooks",
    "set_submodule",
    "unique_name",
    "wrap_forward",
]

ROOT_LABEL = "<root>"

ForwardWrapper = Callable[..., Any]  # (forward, *args, **kwargs) -> output


# ----- paths and names ---------------------------------------------------------------------------
def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root (``prefix == ""``).

    Example:
        >>> join_path("model.layers", "0")
        'model.layers.0'
    """
    return f"{prefix}.{name}" if prefix else name


def label(path: str) -> str:
    """A module path as error messages show it: ``"<root>"`` for the root.

    Example:
        >>> label(""), label("model.layers.0")
        ('<root>', 'model.layers.0')
    """
    return path or ROOT_LABEL


def unique_name(owner: nn.Module, name: str, *, numbered: bool = False) -> str:
    """``name`` (made a valid identifier) if ``owner`` has no such attribute, else ``name_<i>``
    with the first free ``i``; ``numbered=True`` always gives ``name_<i>`` (generated names).

    Example:
        >>> unique_name(nn.Sequential(nn.Linear(2, 2)), "fused.gelu")
        'fused_gelu'
        >>> unique_name(nn.Sequential(nn.Linear(2, 2)), "dropout", numbered=True)
        'dropout_0'
    """
    base = re.sub(r"\W", "_", name) or "submodule"
    if not numbered and not hasattr(owner, base):
        return base
    i = 0
    while hasattr(owner, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``path`` below ``root`` (replacing what is there).

    Example:
        >>> model = nn.Sequential(nn.Sequential(nn.ReLU()))
        >>> set_submodule(model, "0.0", nn.GELU())
        >>> type(model[0][0]).__name__
        'GELU'
    """
    owner, _, name = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, name, new)


# ----- module kinds ------------------------------------------------------------------------------
def is_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored
    transposed, ``(in_features, out_features)``.

    Example:
        >>> is_conv1d(nn.Linear(2, 2))
        False
    """
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "weight")


# ----- hooks -------------------------------------------------------------------------------------
# The hook dictionaries a module carries: replacing a module moves them to the new one, so that
# hooks the user (or a sync primitive) registered keep firing.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` every hook registered on ``old`` (those ``new`` has under the same handle id
    stay).

    Example:
        >>> old, new = nn.ReLU(), nn.GELU()
        >>> _ = old.register_forward_hook(lambda m, i, o: o)
        >>> move_hooks(old, new)
        >>> len(new._forward_hooks)
        1
    """
    for attr in _HOOK_DICTS:
        src = getattr(old, attr, None)
        dst = getattr(new, attr, None)
        if src and dst is not None:
            for key, hook in src.items():
                dst.setdefault(key, hook)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


# ----- forward wrapping --------------------------------------------------------------------------
# Primitives such as ``checkpoint`` and ``fork_rng`` must keep parameter names (state_dict keys),
# so that a Hugging Face checkpoint still loads into the scheduled model. Instead of an outer
# wrapper module, the module's class is swapped for a one-off subclass whose ``forward`` calls the
# wrapper around the original one: names, ``isinstance`` checks and ``deepcopy`` keep working.
def forward_wraps(mod: nn.Module) -> tuple[str, ...]:
    """The kinds of forward wrappers applied to ``mod``, innermost first.

    Example:
        >>> forward_wraps(nn.ReLU())
        ()
    """
    return getattr(type(mod), "_slapo_forward_wraps", ())


def wrap_forward(
    mod: nn.Module,
    kind: str,
    wrapper: ForwardWrapper,
    signature: inspect.Signature | None = None,
) -> None:
    """Make ``mod(...)`` run ``wrapper(original_forward, *args, **kwargs)``.

    Hooks registered on the module keep running around the wrapped forward, as before. The new
    forward takes ``(*args, **kwargs)`` but shows ``signature`` (default: the wrapped forward's)
    to ``inspect.signature(mod.forward)``: callers that read it, e.g. Hugging Face ``Trainer``
    keeping the dataset columns the forward names, see the model's own parameters.

    Example:
        >>> relu = nn.ReLU()
        >>> wrap_forward(relu, "negate", lambda fwd, x: -fwd(x))
        >>> forward_wraps(relu), isinstance(relu, nn.ReLU)
        (('negate',), True)
        >>> str(inspect.signature(relu.forward))
        '(input: torch.Tensor) -> torch.Tensor'
    """
    base = type(mod)
    shown = signature if signature is not None else _bound_signature(mod.forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(super(wrapped, self).forward, *args, **kwargs)

    if shown is not None:
        forward.__signature__ = _with_self(shown)  # type: ignore[attr-defined]
    wrapped = type(
        base.__name__,
        (base,),
        {
            "forward": forward,
            "__module__": base.__module__,
            "__doc__": base.__doc__,
            "_slapo_forward_wraps": forward_wraps(mod) + (kind,),
        },
    )
    wrapped.__qualname__ = base.__qualname__
    mod.__class__ = wrapped


def carry_signature(wrapper: nn.Module, model: nn.Module) -> None:
    """Make ``inspect.signature(wrapper.forward)`` that of ``model.forward``, for a module that
    wraps ``model`` and passes its ``(*args, **kwargs)`` on to it (``DistributedDataParallel``,
    DeepSpeed's engine, RoundPipe's wrappers); calls are unchanged (see :func:`wrap_forward`).

    Example:
        >>> model = nn.Linear(2, 2)
        >>> holder = nn.Sequential(model)
        >>> carry_signature(holder, model)
        >>> str(inspect.signature(holder.forward))
        '(input: torch.Tensor) -> torch.Tensor'
    """
    shown = _bound_signature(model.forward)
    if shown is not None:
        wrap_forward(wrapper, "signature", _pass_through, signature=shown)


def _pass_through(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def _bound_signature(forward: Callable[..., Any]) -> inspect.Signature | None:
    """The signature of a bound forward (without ``self``); None where Python cannot tell it."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _with_self(sig: inspect.Signature) -> inspect.Signature:
    """``sig`` with a leading ``self``: the signature of the class's function, which
    ``inspect`` drops again for the bound method (positional-only, so any ``sig`` takes it)."""
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return sig.replace(parameters=[self_param, *sig.parameters.values()])
