"""``annotate``: attach a key/value to a parameter, carried through ``build``."""

from __future__ import annotations

from typing import Any

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import join_path, label


@register_primitive()
class AnnotatePrimitive(Primitive):
    """Annotate a parameter of this module: ``getattr(param, key) == value`` afterwards.

    Targets read annotations (e.g. which parameters are replicated across tensor-parallel ranks);
    they survive ``build``, including the materialization of a meta-device model.

    Example:
        >>> from torch import nn
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Linear(4, 4))
        >>> sch.annotate("weight", "replicated", True)
        >>> sch.mod.weight.replicated
        True
    """

    name = "annotate"

    @staticmethod
    def apply(sch: Schedule, param_name: str, key: str, value: Any) -> None:
        params = dict(sch.mod.named_parameters(recurse=False))
        if param_name not in params:
            nested = [
                n for n, _ in sch.mod.named_parameters() if n.rsplit(".", 1)[-1] == param_name
            ]
            hint = (
                f' Did you mean sch["{join_path(sch.path, nested[0].rsplit(".", 1)[0])}"]'
                f'.annotate("{param_name}", ...)?'
                if nested
                else ""
            )
            raise PrimitiveError(
                f'annotate: "{label(sch.path)}" ({type(sch.mod).__name__}) has no parameter '
                f'"{param_name}"; its own parameters are: {", ".join(params) or "(none)"}.{hint}'
            )
        if not isinstance(key, str) or not key.isidentifier():
            raise PrimitiveError(f"annotate: key must be an identifier string, got {key!r}")
        setattr(params[param_name], key, value)
        sch.metadata.param_tags.add(key)
