"""Carry values that skip stages: torch's stages only receive from the stage right before them.

A value made in stage ``j`` and used in stage ``k > j + 1`` (e.g. Llama's attention mask and
rotary embeddings, made once before the first layer) is threaded through every stage in between:
each one takes it as an extra input and returns it as an extra output, unchanged.

After the rewrite every stage but the last returns a flat tuple of tensors that is exactly the
next stage's positional inputs, which is what a manual ``PipelineStage`` sends and receives. The
split's root graph (``pipe.split_gm``) is only read: the stages are the product.
"""

from __future__ import annotations

import operator

from torch import fx

from ..exceptions import TargetError

__all__ = ["carry_skipped_values"]

# A value of the split's root graph: ``(stage that makes it, index in its outputs)``; index
# ``None`` is a stage whose output is one value, used whole.
_Value = tuple[int, "int | None"]


def carry_skipped_values(root: fx.GraphModule, stages: list[fx.GraphModule]) -> int:
    """Rewrite the stage graphs so each feeds exactly the next; return how many were carried.

    ``root`` is torch's split graph (read only); ``stages`` its stage modules, in order.

    Example:
        >>> import torch
        >>> from torch.distributed.pipelining import pipeline
        >>> # illustration: a model of 4 stages split at pipe_split() marks; not run here
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> pipe = pipeline(model, (torch.ones(2, 8),), {})  # doctest: +SKIP
        >>> stages = [pipe.get_stage_module(i) for i in range(4)]  # doctest: +SKIP
        >>> carry_skipped_values(pipe.split_gm, stages)  # values carried  # doctest: +SKIP
        6
    """
    calls = [n for n in root.graph.nodes if n.op == "call_module" and n.target.startswith("submod")]
    if len(calls) != len(stages):
        raise TargetError(
            f"pipeline: the split has {len(calls)} stage calls for {len(stages)} stage modules"
        )
    index = {n: i for i, n in enumerate(calls)}
    needs = [[_source(arg, index, k) for arg in call.args] for k, call in enumerate(calls)]
    # What stage k must hand on: each value a later stage uses and stage k makes or receives.
    # The next stage's own inputs come first, in its order, then the values only passing by.
    hand_on: list[list[_Value]] = []
    for k in range(len(calls) - 1):
        values: list[_Value] = []
        for later in needs[k + 1 :]:
            for value in later:
                if value[0] <= k and value not in values:
                    values.append(value)
        hand_on.append(values)
    carried = 0
    for k, stage in enumerate(stages):
        inputs = needs[k] if k == 0 else hand_on[k - 1]
        local = _rewire_inputs(stage, needs[k], inputs, first=k == 0)
        made = _outputs(stage)
        if k == len(stages) - 1:
            _set_output(stage, None)
            break
        mine = {(k, i): node for i, node in enumerate(made)}
        if len(made) == 1:
            mine[(k, None)] = made[0]
        outs = [mine[v] if v[0] == k else local[v] for v in hand_on[k]]
        carried += sum(1 for v in hand_on[k] if v[0] < k)
        _set_output(stage, tuple(outs))
    return carried


def _source(arg: object, index: dict[fx.Node, int], k: int) -> _Value:
    """Which stage makes ``arg`` (an argument of stage ``k``'s call in the root graph)."""
    if isinstance(arg, fx.Node):
        if arg in index:
            return (index[arg], None)
        if arg.op == "call_function" and arg.target is operator.getitem and arg.args[0] in index:
            return (index[arg.args[0]], arg.args[1])  # type: ignore[index,return-value]
        if arg.op == "placeholder" and k == 0:
            return (-1, arg.target)  # type: ignore[return-value]  # a model input
    raise TargetError(
        f"pipeline: stage {k} uses {arg} that no earlier stage produces (e.g. a model input "
        "used after the first stage); move the cut so the first stage consumes it"
    )


def _rewire_inputs(
    stage: fx.GraphModule, own: list[_Value], inputs: list[_Value], first: bool
) -> dict[_Value, fx.Node]:
    """Give ``stage`` one placeholder per value of ``inputs``; return value -> placeholder.

    ``own`` are the values its original placeholders stand for, in order.
    """
    graph = stage.graph
    old = [n for n in graph.nodes if n.op == "placeholder"]
    if len(old) != len(own):
        raise TargetError(
            f"pipeline: a stage has {len(old)} inputs but the split passes it {len(own)}"
        )
    local: dict[_Value, fx.Node] = {}
    for value, ph in zip(own, old):
        if value in local:  # the same value passed twice: one input
            ph.replace_all_uses_with(local[value])
            graph.erase_node(ph)
        else:
            local[value] = ph
    if first:
        return local
    prev: fx.Node | None = None
    for i, value in enumerate(inputs):
        if value not in local:
            with graph.inserting_before(next(iter(graph.nodes))):
                local[value] = graph.placeholder(f"_slapo_carry_{i}")
        ph = local[value]
        # Placeholders in the order the previous stage sends them.
        if prev is None:
            head = next(iter(graph.nodes))
            if head is not ph:
                head.prepend(ph)
        else:
            prev.append(ph)
        prev = ph
    return local


def _outputs(stage: fx.GraphModule) -> list[fx.Node]:
    result = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _set_output(stage: fx.GraphModule, outs: tuple[fx.Node, ...] | None) -> None:
    """Return ``outs`` from ``stage`` (``None``: keep its output) and regenerate its code."""
    if outs is not None:
        next(n for n in stage.graph.nodes if n.op == "output").args = (outs,)
    stage.graph.lint()
    stage.recompile()
