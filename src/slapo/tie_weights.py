"""``analyze_tie_weights``: find parameters shared by several modules (tied embeddings)."""

from __future__ import annotations

from torch import nn

__all__ = ["analyze_tie_weights"]


def analyze_tie_weights(
    top_mod: nn.Module, is_pipeline_partitioned: bool = False
) -> dict[nn.Parameter, set[tuple[str, int]]]:
    """Map each tied parameter to the ``(name, stage)`` pairs under which it appears.

    Only parameters with two or more names are returned. With ``is_pipeline_partitioned``, the
    top module's children are the pipeline stages and ``stage`` is the child's position;
    otherwise every stage is 0. ``shard`` keeps such parameters tied: it shards them once for
    every module that holds them.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)  # lm_head.weight is wte.weight
        >>> ties = analyze_tie_weights(model)
        >>> sorted(n for n, _ in next(iter(ties.values())))
        ['lm_head.weight', 'transformer.wte.weight']
    """
    stage_of = {name: i for i, (name, _) in enumerate(top_mod.named_children())}
    names: dict[int, set[tuple[str, int]]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in top_mod.named_parameters(remove_duplicate=False):
        stage = stage_of.get(name.split(".", 1)[0], 0) if is_pipeline_partitioned else 0
        names.setdefault(id(param), set()).add((name, stage))
        params[id(param)] = param
    return {params[key]: found for key, found in names.items() if len(found) > 1}
