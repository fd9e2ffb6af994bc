"""Tiny random transformers causal LMs, and one training step of them, for the zoo's checks.

:func:`tiny_config` and :func:`tiny_model` make a 2-layer, 64-wide, dropout-free model of any
``model_type`` transformers lists as a causal LM (the per-type fixes are the tables of
:mod:`slapo.testing.zoo_tables`); :func:`sample_batch` draws a batch for it and
:func:`train_step` runs one forward and backward, giving the loss and every gradient by name.

Example:
    >>> from slapo.testing.zoo_models import sample_batch, tiny_model, train_step
    >>> model = tiny_model("llama")
    >>> loss, grads = train_step(model, sample_batch(model))
    >>> bool(loss.isfinite()), "lm_head.weight" in grads
    (True, True)
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from .zoo_tables import (
    BATCH_LAYOUTS,
    NOT_TOKEN_LMS,
    TINY_CAUSAL_LM_PART,
    TINY_LAYER_COUNTS,
    TINY_OPTIONAL,
    TINY_OVERRIDES,
    TINY_SIZES,
)

__all__ = [
    "ZooError",
    "causal_lm_types",
    "sample_batch",
    "tiny_config",
    "tiny_model",
    "train_step",
]

#: Substrings of the config attributes that make training random; each is set to 0 (0.0, or
#: 0 where the field is an int).
RANDOM_ATTRS = ("dropout", "pdrop", "layerdrop")
#: Parameter-name segments that wrappers add (``torch.compile``, checkpoint wrappers); dropped
#: when gradients are matched by name.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


class ZooError(SlapoError):
    """transformers cannot make a tiny config or model of a model type."""


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def causal_lm_types() -> list[str]:
    """Every ``model_type`` with a causal-LM class in transformers, sorted.

    Example:
        >>> "llama" in causal_lm_types()
        True
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError as exc:
        raise ZooError(
            f"transformers knows no model type {model_type!r}; see causal_lm_types()"
        ) from exc


def _sizes_for(config_class: type, sizes: Mapping[str, Any]) -> dict[str, Any]:
    """``sizes`` under the names the constructor of ``config_class`` takes (its own name, or the
    one its ``attribute_map`` gives); the others are dropped."""
    takes = inspect.signature(config_class.__init__).parameters
    aliases = getattr(config_class, "attribute_map", {}) or {}
    out: dict[str, Any] = {}
    for key, value in sizes.items():
        name = key if key in takes else aliases.get(key)
        if name in takes:
            out[name] = value
    return out


def _tiny_sub_configs(config_class: type) -> dict[str, Any]:
    """A tiny config of each sub-config (e.g. ``text_config``, ``vision_config``) that takes
    the usual sizes; a sub-config that does not keeps its defaults."""
    out: dict[str, Any] = {}
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if not inspect.isclass(sub_class) or sub_class.__name__ == "AutoConfig":
            continue
        try:
            out[name] = sub_class(**_sizes_for(sub_class, {**TINY_SIZES, **TINY_OPTIONAL}))
        except Exception:  # noqa: BLE001  (a sub-config with other needs keeps its defaults)
            continue
    return out


def _sub_config_class(config_class: type, name: str) -> type | None:
    """The config class of sub-config ``name`` of ``config_class`` (an ``AutoConfig`` one's
    default model type's); None where it names none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    spec = (getattr(config_class, "sub_configs_defaults", None) or {}).get(name)
    if spec is None:
        return None
    if inspect.isclass(spec.config_class) and spec.config_class.__name__ != "AutoConfig":
        return spec.config_class
    # (the lazy mapping's ``get`` finds nothing: ``in`` and ``[]`` do)
    return CONFIG_MAPPING[spec.model_type] if spec.model_type in CONFIG_MAPPING else None


def _overrides_for(config_class: type, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A type's :data:`TINY_OVERRIDES` as constructor arguments: a dict given for a sub-config
    updates that sub-config's tiny sizes (and makes it, so that a wrong one raises)."""
    out: dict[str, Any] = {}
    for name, value in copy.deepcopy(dict(overrides)).items():
        sub_class = _sub_config_class(config_class, name) if isinstance(value, dict) else None
        if sub_class is not None:
            value = sub_class(**{**_sizes_for(sub_class, {**TINY_SIZES, **TINY_OPTIONAL}), **value})
        out[name] = value
    return out


def _walk_configs(config: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """``config`` and every config nested in its attributes (``text_config``, ...)."""
    from transformers import PreTrainedConfig

    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    yield config
    for value in list(vars(config).values()):
        if isinstance(value, PreTrainedConfig):
            yield from _walk_configs(value, seen)


def _make_deterministic(config: Any) -> None:
    """Every dropout / layer-drop probability of ``config`` and its sub-configs to 0.0, and
    the key/value cache off."""
    for cfg in _walk_configs(config):
        for name, value in list(vars(cfg).items()):
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if is_number and any(part in name for part in RANDOM_ATTRS):
                setattr(cfg, name, type(value)(0))  # an int field (MPT's attn_pdrop) stays int
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False


def tiny_config(model_type: str) -> Any:
    """A small random-weight config of ``model_type``: hidden 64, 2 layers, 4 attention heads
    (2 key/value heads, head_dim 16, where the type takes them), vocabulary 128, 128 positions,
    4 experts of which 2 per token for mixtures of experts, the key/value cache off, and every
    dropout (``*dropout*``, ``*pdrop*``, ``*layerdrop*``, in sub-configs too) 0.0. A type that
    names its sizes otherwise or constrains them gets :data:`TINY_OVERRIDES` on top.

    Raises a :class:`ZooError` when transformers cannot make one, or when the config does not
    take the usual size names (a model of default size would be built instead).

    Example:
        >>> cfg = tiny_config("phi3")
        >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.resid_pdrop
        (64, 2, 0.0)
    """
    config_class = _config_class(model_type)
    kwargs = {
        **_tiny_sub_configs(config_class),
        **_sizes_for(config_class, {**TINY_SIZES, **TINY_OPTIONAL}),
    }
    try:
        kwargs.update(_overrides_for(config_class, TINY_OVERRIDES.get(model_type, {})))
        config = config_class(**kwargs)
    except Exception as exc:  # noqa: BLE001  (any failure of transformers: reported typed)
        raise ZooError(
            f"transformers cannot make a tiny {model_type} config "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    config = _shrink_auto_sub_configs(config, kwargs)
    want = {
        "hidden_size": TINY_SIZES["hidden_size"],
        "num_hidden_layers": TINY_LAYER_COUNTS.get(model_type, TINY_SIZES["num_hidden_layers"]),
    }
    got = next((g for g in _text_sizes(config) if g != want), want)
    if got != want:
        raise ZooError(
            f"the {model_type} config does not take the usual size names (hidden_size, "
            f"num_hidden_layers; got {got}); make a small config of it by hand"
        )
    _make_deterministic(config)
    return config


def _text_config(config: Any) -> Any:
    """The config of the text model (``get_text_config()``); the decoder's where that is
    ambiguous (MusicGen: a text encoder and a decoder)."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError:
        return config.get_text_config(decoder=True)


def _text_sizes(config: Any) -> list[dict[str, Any]]:
    """``hidden_size`` and ``num_hidden_layers`` of the text config; of each of its sub-configs
    that names a hidden size where it names none itself (BLT: patcher, local encoder, global
    transformer, local decoder)."""
    names = ("hidden_size", "num_hidden_layers")
    text = _text_config(config)
    if getattr(text, "hidden_size", None) is not None:
        return [{k: getattr(text, k, None) for k in names}]
    subs = [c for c in _walk_configs(text) if getattr(c, "hidden_size", None) is not None]
    return [{k: getattr(c, k, None) for k in names} for c in subs] or [dict.fromkeys(names)]


def _shrink_auto_sub_configs(config: Any, kwargs: dict[str, Any]) -> Any:
    """``config`` made again with a tiny config of each sub-config whose class only its
    default value names (``sub_configs`` says ``AutoConfig``, e.g. a vision tower's); the
    first ``config`` where that fails."""
    extra: dict[str, Any] = {}
    for name in getattr(type(config), "sub_configs", None) or {}:
        value = getattr(config, name, None)
        if name in kwargs or value is None or not hasattr(value, "to_dict"):
            continue
        try:
            extra[name] = type(value)(**_sizes_for(type(value), {**TINY_SIZES, **TINY_OPTIONAL}))
        except Exception:  # noqa: BLE001  (keeps its default size)
            continue
    if not extra:
        return config
    try:
        return type(config)(**kwargs, **extra)
    except Exception:  # noqa: BLE001  (keeps the default-sized sub-configs)
        return config


def tiny_model(model_type: str, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(model_type))`` in float32 and train mode,
    its random weights drawn after ``torch.manual_seed(seed)`` (the causal-LM class built from
    a sub-config where :data:`TINY_CAUSAL_LM_PART` names one).

    Raises a :class:`ZooError` when transformers cannot build it.

    Example:
        >>> model = tiny_model("qwen3")
        >>> model.training, sum(p.numel() for p in model.parameters()) < 1_000_000
        (True, True)
    """
    import transformers

    if model_type in NOT_TOKEN_LMS:
        raise ZooError(f"no tiny {model_type} model to train: {NOT_TOKEN_LMS[model_type]}")
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    try:
        part = TINY_CAUSAL_LM_PART.get(model_type)
        if part is None:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            model = model_class._from_config(getattr(config, part), dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001  (any failure of transformers: reported typed)
        raise ZooError(
            f"transformers cannot build a tiny {model_type} model "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    return model.train()


def _special_ids(config: Any) -> set[int]:
    """Token ids with a meaning of their own (image, pad, mask, ... tokens) in any sub-config."""
    ids: set[int] = set()
    for cfg in _walk_configs(config):
        for name, value in vars(cfg).items():
            if name.endswith(("_token_id", "_token_index")) and isinstance(value, int):
                ids.add(value)
    return ids


def _vocab_size(model: nn.Module) -> int:
    config = model.config
    text = _text_config(config)
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise ZooError(f"{type(model).__name__}'s config names no vocab_size")
    return vocab


def sample_batch(
    model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A batch for one training step of ``model``: random ``input_ids`` within its vocabulary
    (avoiding the token ids with a meaning of their own, such as image tokens, where other ids
    remain) and ``labels`` the same ids; a model of another input layout (MusicGen's codebooks,
    GIT's image) gets its own (:data:`BATCH_LAYOUTS`).

    Example:
        >>> b = sample_batch(tiny_model("llama"), batch=3, seq=9)
        >>> b["input_ids"].shape, bool((b["labels"] == b["input_ids"]).all())
        (torch.Size([3, 9]), True)
    """
    vocab = _vocab_size(model)
    allowed = torch.tensor([i for i in range(vocab) if i not in _special_ids(model.config)])
    if len(allowed) < 2:
        allowed = torch.arange(vocab)
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return allowed[torch.randint(0, len(allowed), shape, generator=generator)]

    layout = BATCH_LAYOUTS.get(getattr(model.config, "model_type", ""))
    if layout is not None:
        return layout(model.config, batch, seq, draw, generator)
    ids = draw(batch, seq)
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_of(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's scalar loss on ``batch`` (the output's ``loss``, else cross-entropy of the
    next token from its logits)."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, tuple) and out and out[0].dim() == 0:
        loss = out[0]
    if loss is None:
        logits = getattr(out, "logits", None)
        if logits is None:
            raise ZooError(f"{type(model).__name__} returned neither a loss nor logits")
        labels = batch["labels"]
        loss = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
        )
    return loss


def _clean_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def train_step(
    model: nn.Module, batch: Mapping[str, torch.Tensor], seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One forward and backward of ``model`` on ``batch`` after ``torch.manual_seed(seed)``:
    the loss and each parameter's gradient by name (wrapper segments such as ``_orig_mod``
    dropped; None for a parameter the loss does not reach). The gradients are cleared first.

    Example:
        >>> model = tiny_model("gpt2")
        >>> loss, grads = train_step(model, sample_batch(model))
        >>> grads["transformer.wte.weight"].shape
        torch.Size([128, 64])
    """
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss_of(model, batch)
    loss.backward()
    grads = {
        _clean_name(name): None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    return loss.detach(), grads
