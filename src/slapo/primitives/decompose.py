"""``decompose``: split a linear layer into a matmul and a separate bias add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import is_conv1d, label, move_hooks


class DecomposedLinear(nn.Module):
    """``x @ weight.T`` then ``+ bias`` as two operations, so tracing exposes the bias add.

    Holds the original parameters under the same names, so state_dict keys do not change.
    ``transposed=True`` is the layout of transformers' ``Conv1D`` (weight is in x out).
    A trace inlines it into its caller's graph, where the bias add meets what follows it.
    """

    _slapo_inline_when_traced = True

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter, transposed: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.transposed = transposed
        self.in_features, self.out_features = (
            tuple(weight.shape) if transposed else tuple(weight.shape)[::-1]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)
        return out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


@register_primitive()
class DecomposePrimitive(Primitive):
    """Decompose ``nn.Linear`` (or transformers ``Conv1D``) into a matmul and a bias add.

    The bias add can then be matched and fused with what follows (e.g. GELU). The parameters
    stay the same objects with the same names.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["0"].decompose()
        >>> type(sch["0"].mod).__name__
        'DecomposedLinear'
    """

    name = "decompose"

    @staticmethod
    def apply(sch: Schedule) -> None:
        mod = sch.mod
        where = label(sch.path)
        if isinstance(mod, DecomposedLinear):
            raise PrimitiveError(f'"{where}" is already decomposed')
        if isinstance(mod, nn.Linear):
            transposed = False
        elif is_conv1d(mod):
            transposed = True
        else:
            raise PrimitiveError(
                f'decompose on "{where}": only nn.Linear and transformers Conv1D can be '
                f"decomposed, not {type(mod).__name__}"
            )
        if mod.bias is None:
            raise PrimitiveError(f'decompose on "{where}": the layer has no bias to split off')
        new = DecomposedLinear(mod.weight, mod.bias, transposed)
        new.train(mod.training)
        move_hooks(mod, new)
        sch.swap_module(new)
