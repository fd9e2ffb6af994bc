"""Split a scheduled model into pipeline stages at its cuts, with torch.distributed.pipelining.

``torch.distributed.pipelining.pipeline`` traces the model with torch.export (only as deep as
the cuts need: everything else stays inside the traced graph) and splits it after each cut
module. Each stage is a ``GraphModule`` whose parameters keep their user-visible names
(``transformer.h.1.attn.c_attn.weight``); this module prunes what a stage does not use and
checks that every cut became a boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..exceptions import TargetError
from .carry import carry_skipped_values
from .tp_trace import opaque_collectives

__all__ = ["Partition", "partition_model", "stage_metas"]


@dataclass
class Partition:
    """The stage modules of a model, in pipeline order, and the cuts that made them."""

    stages: list[fx.GraphModule]
    cuts: list[str]


def partition_model(
    model: nn.Module,
    cuts: Sequence[str],
    args: tuple,
    kwargs: dict[str, Any],
    grad: bool = False,
) -> Partition:
    """Trace ``model`` on one microbatch ``(args, kwargs)`` and split it after each cut.

    ``grad=True`` traces with autograd on: tensor-parallel ``sync(mode="bwd_post")`` hooks only
    act on inputs that require grad. The model's own ``torch.no_grad`` regions are dropped from
    that trace, as the ``grad=False`` trace drops them too. Tensor-parallel collectives stay
    whole custom-op calls (:func:`~slapo.pipeline.tp_trace.opaque_collectives`), so each stage
    runs them, forward and backward, on its tensor-parallel group.

    Example:
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.zeros(2, 8, dtype=torch.long)
        >>> part = partition_model(gpt2, ["transformer.h.0"], (ids[:1],), {"use_cache": False})
        >>> [type(s).__name__ for s in part.stages]
        ['GraphModule', 'GraphModule']
    """
    # deferred: torch.distributed.pipelining is not loaded by `import torch`; only pipelines need it
    from torch.distributed.pipelining import SplitPoint, pipeline

    calls = _count_calls(model, cuts)
    try:
        # Traced without autograd where possible: a grad-mode region inside the model (Llama's
        # rotary embedding runs under @torch.no_grad) would become a set_grad_enabled region that
        # torch's submodule outlining splits wrongly. The graph records the same aten ops either
        # way, and autograd runs when the stages run.
        trace_mode = _model_no_grad_ignored() if grad else torch.no_grad()
        with opaque_collectives(), trace_mode:
            pipe = pipeline(model, args, kwargs, split_spec={c: SplitPoint.END for c in cuts})
    except Exception as exc:  # noqa: BLE001  (re-raised naming the cuts)
        raise TargetError(
            f"pipeline: cannot trace the model to split it after {', '.join(cuts)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _restore(model, cuts)
        for handle in calls.handles:
            handle.remove()
    bad = {c: n for c, n in calls.counts.items() if n != 1}
    if bad:
        what = "; ".join(f'"{c}" runs {n} times' for c, n in bad.items())
        raise TargetError(
            f"pipeline: a stage boundary must be a module that runs exactly once per forward: "
            f"{what}. Cut after another module (e.g. a whole layer)."
        )
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    carry_skipped_values(pipe.split_gm, stages)
    if len(stages) != len(cuts) + 1:
        raise TargetError(
            f"pipeline: {len(cuts)} cuts ({', '.join(cuts)}) gave {len(stages)} stages instead of "
            f"{len(cuts) + 1}; a cut after the last module leaves an empty stage"
        )
    for stage in stages:
        _prune(stage)
    return Partition(stages, _in_run_order(cuts, calls.order))


def stage_metas(
    stages: Sequence[nn.Module], args: tuple[torch.Tensor, ...]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None:
    """Each stage's inputs and outputs as meta tensors, from a run of the chain on fake tensors.

    ``PipelineStage`` takes them as ``input_args``/``output_args`` and then skips its run-time
    shape inference: a real forward on the first step whose graph, on the first stage (no
    backward runs through token ids), kept about a microbatch of activations alive for the
    whole run. Autograd is on, so ``requires_grad`` is what the real run gives each value
    (outputs that depend on no parameter, e.g. rotary tables, need no gradient).

    Returns None where the stages cannot run on fake tensors (e.g. collectives without a fake
    kernel): the stages then infer the shapes at run time, as before.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: only pipelines need it

    def meta(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return out.requires_grad_(t.requires_grad)

    metas = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.enable_grad():
            values = tuple(mode.from_tensor(a) for a in args)
            for stage in stages:
                out = stage(*values)
                out = out if isinstance(out, tuple) else (out,)
                if not all(isinstance(o, torch.Tensor) for o in out):
                    return None
                metas.append((tuple(map(meta, values)), tuple(map(meta, out))))
                values = out
    except Exception:  # noqa: BLE001  (any failure: fall back to run-time inference)
        return None
    return metas


@contextlib.contextmanager
def _model_no_grad_ignored() -> Iterator[None]:
    """Trace with autograd on, ignoring ``torch.no_grad`` regions inside the model.

    torch's submodule outlining mis-splits a grad-mode region (Llama's rotary embedding runs
    under ``@torch.no_grad``): the outlined call loses its inputs. Like a trace under
    ``no_grad``, this records the region's ops as plain ops; they run with autograd at run time.
    """
    cls = torch.autograd.grad_mode.no_grad
    saved = cls.__enter__, cls.__exit__
    cls.__enter__ = lambda self: None  # type: ignore[method-assign,assignment]
    cls.__exit__ = lambda self, *exc: None  # type: ignore[method-assign,assignment]
    try:
        with torch.enable_grad():
            yield
    finally:
        cls.__enter__, cls.__exit__ = saved  # type: ignore[method-assign]


class _Calls:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.order: list[str] = []
        self.handles: list[Any] = []


def _count_calls(model: nn.Module, cuts: Sequence[str]) -> _Calls:
    """Count how often each cut module runs during the trace (hooks run in non-strict export)."""
    calls = _Calls()
    for cut in cuts:
        calls.counts[cut] = 0

        def hook(_mod: nn.Module, _args: Any, _out: Any, cut: str = cut) -> None:
            calls.counts[cut] += 1
            if cut not in calls.order:
                calls.order.append(cut)

        calls.handles.append(model.get_submodule(cut).register_forward_hook(hook))
    return calls


def _restore(model: nn.Module, cuts: Sequence[str]) -> None:
    """Undo ``annotate_split_points``, which patches ``forward`` on the user's modules."""
    for cut in cuts:
        mod = model.get_submodule(cut)
        if "_orig_forward" in mod.__dict__:
            del mod.__dict__["_orig_forward"]
            mod.__dict__.pop("forward", None)


def _in_run_order(cuts: Sequence[str], order: list[str]) -> list[str]:
    return order + [c for c in cuts if c not in order]


def _prune(stage: fx.GraphModule) -> None:
    """Drop submodules, parameters and buffers the stage's graph never uses.

    The split keeps a few (e.g. the second name of a tied weight) on stages that do not use
    them; they would show up in ``named_parameters()`` with no gradient.
    """
    used = {n.target for n in stage.graph.nodes if n.op in ("call_module", "get_attr")}

    def needed(path: str) -> bool:
        return path in used or any(t.startswith(path + ".") for t in used)

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, _ in list(mod.named_parameters(recurse=False)):
            if not needed(prefix + name):
                delattr(mod, name)
        for name, _ in list(mod.named_buffers(recurse=False)):
            if not needed(prefix + name):
                delattr(mod, name)
        for name, child in list(mod.named_children()):
            path = prefix + name
            if path in used:
                continue  # called as a whole: keep all of it
            if needed(path):
                visit(child, path + ".")
            else:
                delattr(mod, name)

    with torch.no_grad():
        visit(stage, "")
