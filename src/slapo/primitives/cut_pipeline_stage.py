"""``cut_pipeline_stage``: end a pipeline stage after this module."""

from __future__ import annotations

from torch import nn

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import label


def pipeline_cuts(sch: Schedule) -> list[str]:
    """The paths cut with ``cut_pipeline_stage`` under the root of ``sch``, in the order applied."""
    names = {CutPipelineStagePrimitive.name, *CutPipelineStagePrimitive.aliases}
    return [r.path for r in sch.root.metadata.primitives if r.name in names]


@register_primitive()
class CutPipelineStagePrimitive(Primitive):
    """End a pipeline stage right after this module runs; the next stage starts after it.

    Works on a module at any depth, e.g. one decoder layer: ``n`` cuts give ``n + 1`` stages. The
    ``"pipeline"`` target traces the model as far as the cuts need (torch.export through
    ``torch.distributed.pipelining``) and keeps user-visible parameter names in every stage. The
    module must run exactly once per forward; a list of layers (never called itself) or the
    root cannot be a boundary.

    Example:
        >>> import slapo, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> sch = slapo.create_schedule(gpt2)
        >>> sch["transformer.h.1"].cut_pipeline_stage()      # alias: pipeline_split()
        >>> # building the pipeline needs one process per stage (torchrun): not run here
        >>> engine, opt = slapo.build(sch, target="pipeline", num_microbatches=2)  # doctest: +SKIP
    """

    name = "cut_pipeline_stage"
    aliases = ("pipeline_split",)

    @staticmethod
    def apply(sch: Schedule) -> None:
        where = label(sch.path)
        if sch.parent is None:
            raise PrimitiveError(
                "cut_pipeline_stage() on the root: a stage boundary goes after a submodule, "
                'e.g. sch["transformer.h.1"].cut_pipeline_stage()'
            )
        if sch.is_module_list or isinstance(sch.mod, nn.ModuleDict):
            first = next(iter(sch.child), "0")
            raise PrimitiveError(
                f'cut_pipeline_stage() on "{where}", a container of layers that is never called '
                f'itself: cut after one of its layers, e.g. "{sch.path}.{first}"'
            )
        if sch.path in pipeline_cuts(sch):
            raise PrimitiveError(f'"{where}" already ends a pipeline stage; cut it once')

    @classmethod
    def is_verifiable(cls) -> bool:
        return False  # a cut changes no numerics; the pipeline target checks it at build
