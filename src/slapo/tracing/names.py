"""Dynamo's names of module calls, for graphs traced with ``tracer="dynamo"``.

Slapo's dynamo tracer captured one flat graph in which dynamo named each module call after its
attribute path from the traced module: ``self.query`` became ``self_query``,
``self.attention.query`` ``self_attention_query``. Published patterns match those names
(``call_module(r"self_(query|key|value)", x)``). Our ``"dynamo"`` capture is torch.export, and
it keeps every submodule under its own path, so that parameter names, schedule paths
(``sch["query"]``) and checkpoints stay what they were. Instead, each ``GraphModule`` of such a
trace records its path from the traced module, and name matching (:mod:`slapo.pattern`) also
knows a call by dynamo's name.
"""

from __future__ import annotations

from torch import fx, nn

__all__ = ["DYNAMO_PATH", "dynamo_name", "mark_dynamo_names"]

DYNAMO_PATH = "slapo_dynamo_path"  # key in GraphModule.meta: the path from the traced module


def mark_dynamo_names(gm: nn.Module) -> None:
    """Record on every ``GraphModule`` in ``gm`` (itself included) its path from ``gm``, so
    that its module calls also answer to dynamo's names (:func:`dynamo_name`).

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
        >>> mark_dynamo_names(gm)
        >>> dynamo_name(gm, "0")
        'self_0'
    """
    for path, sub in gm.named_modules():
        if isinstance(sub, fx.GraphModule):
            sub.meta[DYNAMO_PATH] = path


def dynamo_name(gm: nn.Module, target: str) -> str | None:
    """Dynamo's name of a call of ``gm``'s submodule ``target`` (``"self_" + path`` with dots
    as underscores, the path taken from the module traced with ``tracer="dynamo"``), or None
    where ``gm`` was not traced so.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
        >>> dynamo_name(gm, "0") is None
        True
    """
    meta = getattr(gm, "meta", None)
    prefix = meta.get(DYNAMO_PATH) if isinstance(meta, dict) else None
    if prefix is None:
        return None
    path = f"{prefix}.{target}" if prefix else target
    return "self_" + path.replace(".", "_")
