"""A layout's step at full depth from fake steps of two and three of its layers.

A decoder is a stack of identical layers between an embedding and a head: what one step of it
holds and does (bytes saved for backward, FLOPs, bytes moved, collectives) is the ends' share plus
the depth times one layer's. So the planner runs the fake step of
:func:`slapo.memory.layout_step` twice, on the model cut to two and to three layers (config-only
copies, nothing allocated; :data:`DEPTHS`), and extends every count linearly to the real depth
(:func:`extend_to_depth`); :func:`slapo.memory.apply_layout` then models the engine on the whole
model's real parameters (built on the meta device in a fraction of a second). An 80-layer 70B
model is profiled in about half a second per layout instead of six.

Where only some blocks are checkpointed (``ckpt_ratio`` strictly between 0 and 1: the first
``ceil(ratio x layers)``) the layers are of two kinds, which two shallow steps cannot tell
apart: the fake step then runs at the whole depth (:func:`_profiled_depths`).

What does not grow with depth stays exact (the embedding, the head and the loss's float32
logits, FSDP's gathered root and two blocks: :func:`slapo.memory.apply_layout` counts those from
the whole model). ``tests/plan/test_profile.py`` checks the extension against the fake step of
the whole model.

Example:
    >>> import transformers
    >>> from slapo.train import TrainConfig
    >>> from slapo.train.run_memory import layout_spec
    >>> transformers.LlamaConfig(  # a config-only directory of a tiny 8-layer llama
    ...     hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
    ... ).save_pretrained("llama-8-layers")
    >>> config = json.loads(Path("llama-8-layers/config.json").read_text())
    >>> cfg = TrainConfig(model="./llama-8-layers", batch_size=2, seq_len=16, target="fsdp")
    >>> with shallow_configs(config) as shallow:  # fake steps of 2 and 3 layers, extended to 8
    ...     profile = profile_config(cfg, layout_spec(cfg, dp=4), shallow, 8)
    >>> profile.estimate.required > 0, profile.counts.flops[("forward", "matmul")] > 0
    (True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..memory import MemoryEstimate, apply_layout, layout_step
from ..model_schedule.helpers import stage_cuts
from .step_time import PlanError, StepCounter, StepCounts

__all__ = [
    "StepProfile",
    "extend_to_depth",
    "layer_list_path",
    "model_shape",
    "profile_config",
    "shallow_configs",
]

#: The depths the fake steps run at: two layers and three (their difference is one layer).
#: Not one: a one-layer step can peak where deeper ones do not (at the loss, before any
#: gradient exists, where two layers already peak later in the backward).
DEPTHS = (2, 3)
#: MemoryEstimate's byte counts that grow with depth.
_LINEAR_FIELDS = (
    "params", "buffers", "grads", "optimizer_state", "activations", "live_peak", "engine",
    "weight_copies",
)  # fmt: skip


@dataclass(frozen=True)
class StepProfile:
    """One rank's step of a layout: its memory (:func:`slapo.memory.apply_layout` of the fake
    step, extended to full depth) and its work (:class:`~slapo.plan.step_time.StepCounts`).

    Attributes:
        estimate: the rank's :class:`~slapo.memory.MemoryEstimate` (the stage needing most).
        counts: the fake step's work: one microbatch of the whole model when ``pp`` > 1.
        model: the whole model as the rank holds it (meta device), for the time model.
    """

    estimate: MemoryEstimate
    counts: StepCounts
    model: nn.Module


def layer_list_path(model: nn.Module, layers: int) -> str:
    """The path of the ``nn.ModuleList`` of ``layers`` blocks holding most parameters.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(
        ...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ... )
        >>> layer_list_path(transformers.LlamaForCausalLM(cfg), cfg.num_hidden_layers)
        'model.layers'
    """
    best, best_n = None, -1
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == layers:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = path, n
    if best is None:
        raise PlanError(
            f"{type(model).__name__} has no list of {layers} layers (config num_hidden_layers): "
            "the planner extends a stack of identical layers; give a decoder model"
        )
    return best


#: The transformers names of the shape fields the planner reads (``model_shape``).
SHAPE_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "num_experts",
    "num_local_experts", "moe_intermediate_size",
)  # fmt: skip


def _layers_key(config: dict[str, Any]) -> str:
    """The raw ``config.json`` key of the layer count (GPT-2 writes ``n_layer``)."""
    if "num_hidden_layers" in config:
        return "num_hidden_layers"
    import transformers

    try:
        cls = transformers.AutoConfig.for_model(config["model_type"]).__class__
    except (KeyError, ValueError) as exc:
        raise PlanError(f"config.json: no known model_type ({exc})") from exc
    return cls.attribute_map.get("num_hidden_layers", "num_hidden_layers")


def model_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The shape fields (:data:`SHAPE_FIELDS`) of a raw ``config.json`` dict, under their
    transformers names whatever the model type calls them (GPT-2's ``n_embd``, ``n_layer``).

    Example:
        >>> model_shape({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12})
        {'hidden_size': 768, 'num_hidden_layers': 12, 'num_attention_heads': 12, ...}
    """
    import transformers

    try:
        cfg = transformers.AutoConfig.for_model(**config)
    except (KeyError, ValueError, TypeError) as exc:
        raise PlanError(f"config.json cannot be read as a transformers config: {exc}") from exc
    shape = {name: getattr(cfg, name, None) for name in SHAPE_FIELDS}
    if shape["intermediate_size"] is None:  # GPT-2: n_inner, 4 x hidden by default
        shape["intermediate_size"] = getattr(cfg, "n_inner", None) or 4 * shape["hidden_size"]
    if shape["num_key_value_heads"] is None:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    return shape


def _with_depth(config: dict[str, Any], depth: int) -> dict[str, Any]:
    """``config`` cut to ``depth`` layers: its layer count and every per-layer list."""
    key = _layers_key(config)
    layers = config[key]
    out = dict(config, **{key: depth})
    for key, value in config.items():
        if isinstance(value, list) and len(value) == layers and layers > depth:
            out[key] = value[:depth]
    # MoE configs that keep the first k layers dense keep them dense only as deep as the cut
    for key in ("first_k_dense_replace",):
        if isinstance(out.get(key), int):
            out[key] = min(out[key], depth - 1) if out[key] >= depth else out[key]
    return out


@contextlib.contextmanager
def shallow_configs(config: dict[str, Any]) -> Iterator[dict[int, str]]:
    """Config-only model directories of ``config`` cut to each of :data:`DEPTHS` layers.

    Example:
        >>> config = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80}
        >>> with shallow_configs(config) as dirs:  # in a temporary folder, removed after
        ...     sorted(dirs)
        [2, 3]
    """
    layers = config.get(_layers_key(config))
    if not isinstance(layers, int) or layers < 2:
        raise PlanError(
            "the model config needs at least 2 layers (the planner extends a stack of "
            f"layers), got {layers!r}"
        )
    with tempfile.TemporaryDirectory(prefix="slapo-plan-") as root:
        dirs = {}
        for depth in DEPTHS:
            path = Path(root) / f"depth{depth}"
            path.mkdir()
            (path / "config.json").write_text(json.dumps(_with_depth(config, depth)))
            dirs[depth] = str(path)
        yield dirs


def extend_to_depth(
    one: MemoryEstimate, two: MemoryEstimate, layers: int, layer_list: str,
    depths: tuple[int, int] = DEPTHS,
) -> MemoryEstimate:  # fmt: skip
    """The fake step's estimate of ``layers`` layers from those of ``depths`` layers (``one``
    and ``two``): every count ``one + (layers - d1) / (d2 - d1) x (two - one)``; the last
    layer's entries of ``by_module`` repeated.

    Example:
        >>> import transformers
        >>> import slapo
        >>> def tiny_llama(layers):
        ...     return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...         hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        ...         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ...     ))
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> at_2 = slapo.estimate_memory(tiny_llama(2), batch)
        >>> at_3 = slapo.estimate_memory(tiny_llama(3), batch)
        >>> at_80 = extend_to_depth(at_2, at_3, 80, "model.layers")
        >>> at_80.activations == at_2.activations + 78 * (at_3.activations - at_2.activations)
        True
    """
    n = (layers - depths[0]) / (depths[1] - depths[0])
    last = depths[1] - 1

    def line(a: float | None, b: float | None) -> int | None:
        if a is None or b is None:
            return None
        return max(0, round(a + n * (b - a)))

    def lines(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: line(a.get(k, 0), b.get(k, 0)) or 0 for k in {*a, *b}}

    fields: dict[str, Any] = {f: line(getattr(one, f), getattr(two, f)) for f in _LINEAR_FIELDS}
    fields["grads_at_peak"] = line(one.grads_at_peak, two.grads_at_peak)
    fields["forward_peak"] = line(one.forward_peak, two.forward_peak)
    fields["backward_peak"] = line(one.backward_peak, two.backward_peak)
    fields["backward_other_peak"] = line(one.backward_other_peak, two.backward_other_peak)
    fields["grads_at_other_peak"] = line(one.grads_at_other_peak, two.grads_at_other_peak)
    # the forward's and the backward's peaks grow at their own rates: the deeper model's
    # live peak is the larger of them (or the optimizer's, which grows with the parameters)
    fields["live_peak"] = max(
        fields["live_peak"], fields["forward_peak"] or 0, fields["backward_peak"] or 0
    )
    fields["engine_parts"] = lines(one.engine_parts, two.engine_parts)
    fields["rounding"] = lines(one.rounding, two.rounding)
    fields["by_module"] = _repeat_layer(two.by_module, layers, layer_list, last)
    fields["peak_temporaries"] = {
        at: _repeat_layer(by_module, layers, layer_list, last)
        for at, by_module in two.peak_temporaries.items()
    }  # fmt: skip
    return dataclasses.replace(two, **fields)


def _repeat_layer(
    by_module: dict[str, int], layers: int, layer_list: str, last: int
) -> dict[str, int]:
    """``by_module`` of a shallow model, its ``last`` layer's entries repeated to ``layers``."""
    second = f"{layer_list}.{last}"
    out: dict[str, int] = {}
    for key, nbytes in by_module.items():
        if key == second or key.startswith(second + "."):
            rest = key[len(second) :]
            for i in range(last, layers):
                out[f"{layer_list}.{i}{rest}"] = nbytes
        else:
            out[key] = nbytes
    return out


def _batch(cfg: Any) -> dict[str, torch.Tensor]:
    ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def _rank_groups(cfg: Any, spec: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The layout and groups one rank of ``spec`` estimates under (as ``estimate_config``)."""
    from ..memory import fake_layout_groups
    from ..train.job_layout import Layout

    with contextlib.ExitStack() as ctx:
        layout, groups = Layout(), {}
        if max(cfg.tp, spec.cp, spec.ep) > 1:
            groups = ctx.enter_context(fake_layout_groups(cfg.tp, spec.cp, spec.ep, 0))
            if cfg.tp > 1:
                layout = Layout(rank=0, world=cfg.tp, tp_group=groups["tp"], tp_size=cfg.tp)
        yield layout, groups


def _profiled_depths(cfg: Any, layers: int) -> tuple[int, ...]:
    """The depths whose fake steps give ``layers`` layers' step: :data:`DEPTHS`, extended; the
    whole depth where only some blocks are checkpointed (``ckpt_ratio`` strictly between 0 and 1
    checkpoints the first ``ceil(ratio x layers)``): then the layers differ, and two shallow
    steps (each with its own first blocks checkpointed) cannot say one layer of each kind."""
    from ..train.job_layout import schedule_knobs

    ratio = schedule_knobs(cfg).get("ckpt_ratio") or 0.0
    mixed = 0 < math.ceil(ratio * layers) < layers
    return (layers,) if mixed else DEPTHS


def _fake_step(cfg: Any, spec: Any, optimizer: tuple[Any, dict[str, Any]]) -> tuple[Any, Any]:
    from ..train.run_memory import estimate_placement, estimated_schedule

    with _rank_groups(cfg, spec) as (layout, groups):
        sch, batch = estimated_schedule(cfg, spec, _batch(cfg), layout, groups)
        counter = StepCounter()
        with counter:
            base = layout_step(
                sch, batch, spec, optimizer=optimizer[0], optimizer_kwargs=optimizer[1],
                device=estimate_placement(cfg)[0],  # cfg.device as slapo train resolves it
            )  # fmt: skip
    return base, StepCounts.of(counter)


def _whole_schedule(cfg: Any, spec: Any) -> Any:
    from ..train.run_memory import estimated_schedule

    with _rank_groups(cfg, spec) as (layout, groups):
        return estimated_schedule(cfg, spec, _batch(cfg), layout, groups)[0]


def profile_config(
    cfg: Any,
    spec: Any,
    shallow: dict[int, str],
    layers: int,
    *,
    cache: dict[Any, Any] | None = None,
) -> StepProfile:
    """The :class:`StepProfile` of rank 0's stage needing the most memory of ``spec`` for what
    ``slapo train`` builds from ``cfg`` (a :class:`~slapo.train.TrainConfig` whose ``model`` is
    a config-only directory of ``layers`` layers; ``shallow``: :func:`shallow_configs` of it).

    ``cache`` (a dict kept between calls) reuses the fake steps of layouts that share them
    (same tp, cp, ep, checkpointing, microbatch and engine cast) and the whole model's schedules.

    Example:
        >>> import transformers
        >>> from slapo.train import TrainConfig
        >>> from slapo.train.run_memory import layout_spec
        >>> transformers.LlamaConfig(  # a config-only directory of a tiny 8-layer llama
        ...     hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ... ).save_pretrained("llama-8")
        >>> config = json.loads(Path("llama-8/config.json").read_text())
        >>> cfg = TrainConfig(model="./llama-8", batch_size=2, seq_len=16, target="fsdp")
        >>> with shallow_configs(config) as shallow:
        ...     p = profile_config(cfg, layout_spec(cfg, dp=32), shallow, 8)
        >>> p.estimate.required > 0
        True
    """
    cache = {} if cache is None else cache
    optimizer = (torch.optim.AdamW, {"lr": cfg.lr})
    micro = cfg.batch_size // spec.num_microbatches if spec.pp > 1 else cfg.batch_size
    depths = _profiled_depths(cfg, layers)
    step_key = (
        "step", cfg.tp, spec.cp, spec.ep, cfg.ckpt_ratio, cfg.ckpt_policy, cfg.compile_blocks,
        micro, spec.pp > 1, spec.casts_module, spec.precision, cfg.seq_len, depths,
    )  # fmt: skip
    if step_key not in cache:
        # one microbatch's fake step is all a pipeline's layout_step runs: the same for any pp
        one_stage = dataclasses.replace(spec, pp=1, num_microbatches=1, rank=0)
        if spec.pp > 1:  # the stages autocast (no engine casts their module)
            one_stage = dataclasses.replace(one_stage, target="eager", dp=1)
        steps = {}
        for depth in depths:
            model = shallow[depth] if depth in shallow else cfg.model
            shallow_cfg = dataclasses.replace(cfg, model=model, pp=1, batch_size=micro)
            steps[depth] = _fake_step(shallow_cfg, one_stage, optimizer)
        cache[step_key] = steps
    steps = cache[step_key]
    # the engine model reads the whole model's parameters and pipeline cuts: the same for any
    # checkpointing
    whole_key = ("whole", cfg.tp, spec.cp, spec.ep)
    if whole_key not in cache:
        whole = dataclasses.replace(cfg, pp=1)
        cache[whole_key] = _whole_schedule(whole, dataclasses.replace(spec, pp=1, rank=0))
    sch = cache[whole_key]
    path = layer_list_path(sch.mod, layers)
    # the cuts slapo train's schedule makes (slapo.model_schedule.helpers.cut_stages); RoundPipe
    # streams the model a layer at a time
    paths = [f"{path}.{i}" for i in range(layers)]
    cuts = stage_cuts(paths, spec.pp) if spec.pp > 1 else []
    if spec.target == "roundpipe":
        cuts = paths[:-1]
    d1, d2 = DEPTHS
    if layers in steps:  # as shallow as a profile's own step, or profiled whole: that step
        base, counts = steps[layers]
    else:
        base = extend_to_depth(steps[d1][0], steps[d2][0], layers, path)
        w = (layers - d1) / (d2 - d1)
        counts = StepCounts.combine((steps[d1][1], 1 - w), (steps[d2][1], w))
    # the first stage keeps the most microbatches in flight, the last one the loss: the others
    # hold no more than the first
    stages = sorted({0, spec.pp - 1})
    estimates = [
        apply_layout(base, sch.mod, dataclasses.replace(spec, rank=s * spec.cp * spec.tp), cuts)
        for s in stages
    ]  # fmt: skip
    return StepProfile(max(estimates, key=lambda e: e.reserved), counts, sch.mod)
