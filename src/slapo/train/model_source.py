"""What ``--model`` names: a built-in family, a transformers causal-LM model type, or a local
model directory; and how each is built.

A family (``llama``, ``gpt2``, ...) is built by :func:`slapo.train.presets.build_model` as before.
A model type (``phi3``, ``qwen3``, any key of transformers' causal-LM mapping) becomes a
``--preset``-sized model of that architecture with random weights. A directory (``config.json``
and safetensors weights, as ``save_pretrained`` writes them) is built with its own class on the
meta device and its weights are then assigned from the safetensors files, so they are never
materialized twice.

Example:
    >>> source = resolve_model("phi3")
    >>> source.kind, source.model_type
    ('type', 'phi3')
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import VOCAB_SIZE
from ..exceptions import InputError
from .families import MODELS, PRESETS

__all__ = [
    "ModelSource",
    "check_weights",
    "config_for",
    "load_model",
    "max_positions",
    "model_config",
    "model_label",
    "resolve_model",
]

#: The config attributes that bound the sequence length, in the order they are read.
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``.

    Attributes:
        name: what ``--model`` said.
        kind: ``"family"`` (built-in), ``"type"`` (a transformers model type) or ``"dir"``.
        model_type: the transformers ``config.model_type``.
        path: the model directory (kind ``"dir"`` only).
    """

    name: str
    kind: str
    model_type: str
    path: Path | None = None


def _causal_types() -> dict[str, str]:
    # deferred: transformers takes seconds to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith(("~", ".")) or Path(name).is_dir()


def model_label(name: str) -> str:
    """A short name of ``--model`` for a run directory: the family or type, or the directory's
    own name.

    Example:
        >>> model_label("./models/my-model/"), model_label("phi3")
        ('my-model', 'phi3')
    """
    if not _looks_like_path(name):
        return name
    return Path(name).expanduser().resolve().name or "model"


def resolve_model(name: str) -> ModelSource:
    """The :class:`ModelSource` of ``--model name``; an :class:`InputError` says what is wrong.

    A built-in family name wins over a directory of the same name (write ``./llama`` for that).

    Example:
        >>> resolve_model("llama").kind
        'family'
    """
    if name in MODELS:
        return ModelSource(name, "family", name)
    if _looks_like_path(name):
        return _resolve_dir(name)
    if name in _causal_types():
        return ModelSource(name, "type", name)
    raise InputError(
        f"--model must be one of the families ({', '.join(MODELS)}), a transformers causal-LM "
        f"model type (e.g. phi3, qwen3) or a model directory (a path: ./my-model); got {name!r}"
    )


def _resolve_dir(name: str) -> ModelSource:
    """A model directory, checked before anything is built: config, model type, weights."""
    path = Path(name).expanduser()
    if not path.exists():
        raise InputError(
            f"--model {name}: no such directory; give a directory that "
            "save_pretrained wrote (config.json + model.safetensors)"
        )
    if not path.is_dir():
        raise InputError(
            f"--model {name} is a file; give the directory that holds config.json "
            "and the safetensors weights"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(
            f"--model {name} has no config.json: not a model directory; write one "
            "with model.save_pretrained(DIR) (or config.save_pretrained(DIR))"
        )
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise InputError(
            f"--model {name}: cannot read {config_file} as a JSON object "
            f"({type(exc).__name__}: {exc}); rewrite it with save_pretrained"
        ) from exc
    if not isinstance(model_type, str):
        raise InputError(
            f"--model {name}: {config_file} names no model_type; rewrite it with "
            "config.save_pretrained(DIR)"
        )
    if model_type not in _causal_types():
        raise InputError(
            f"--model {name}: model type {model_type!r} has no causal-LM class in "
            "transformers; slapo train trains causal LMs from a directory"
        )
    # the weights are checked when they are loaded: a memory estimate reads the config only
    return ModelSource(name, "dir", model_type, path)


def check_weights(source: ModelSource) -> None:
    """Raise an :class:`InputError` when a model directory holds no safetensors weights
    (training needs them; an estimate of a config-only directory does not).

    Example:
        >>> import transformers
        >>> transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2).save_pretrained("config-only")
        >>> check_weights(resolve_model("./config-only"))
        Traceback (most recent call last):
        slapo.exceptions.InputError: --model ./config-only holds no model.safetensors ...
    """
    path = source.path
    assert path is not None
    if not (path / WEIGHTS).is_file() and not (path / WEIGHTS_INDEX).is_file():
        raise InputError(
            f"--model {source.name} holds no {WEIGHTS} (nor {WEIGHTS_INDEX}); save the "
            "weights with model.save_pretrained(DIR) (safetensors)"
        )


def model_config(source: ModelSource, preset: str, seq_len: int, vocab_size: int) -> Any:
    """The transformers config of a ``type`` or ``dir`` source, the key/value cache off.

    A ``type`` gets the ``preset``'s sizes, ``vocab_size`` token embeddings and room for
    ``max(seq_len, 128)`` positions; a ``dir`` keeps its own config.

    Example:
        >>> model_config(resolve_model("qwen3"), "tiny", 128, 256).hidden_size
        128
    """
    import transformers as tf  # deferred: transformers takes seconds to import
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if source.kind == "dir":
        try:
            config = tf.AutoConfig.from_pretrained(str(source.path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"--model {source.name}: transformers cannot read its config.json "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        config.use_cache = False  # training reads no key/value cache
        return config
    hidden, layers, heads, kv_heads, inter = PRESETS[preset]
    sizes = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": inter,
        "vocab_size": vocab_size,
        "max_position_embeddings": max(seq_len, 128),
        # bos/eos 0: the byte tokenizer's end of text; no pad id (some types default to one
        # beyond a small vocabulary, which nn.Embedding refuses as padding_idx)
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": None,
        "use_cache": False,
    }
    # sizes some types have and others lack (or derive: Falcon's head_dim is read-only), set
    # where the config takes them; mixtures of experts get a few small experts
    optional = {
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": inter, "shared_expert_intermediate_size": inter,
    }  # fmt: skip
    config_class = CONFIG_MAPPING[source.model_type]
    takes = inspect.signature(config_class.__init__).parameters
    sizes.update({k: v for k, v in optional.items() if k in takes})
    try:
        config = config_class(**sizes)
    except (AttributeError, TypeError, ValueError) as exc:
        raise InputError(
            f"--model {source.name}: transformers cannot make a small config of it "
            f"({type(exc).__name__}: {exc}); save a small model of it with save_pretrained and "
            "pass that directory"
        ) from exc
    if (
        getattr(config, "hidden_size", None) != hidden
        or getattr(config, "num_hidden_layers", None) != layers
    ):
        raise InputError(
            f"--model {source.name}: its config does not take the usual size names "
            "(hidden_size, num_hidden_layers); save a small model of it with "
            "save_pretrained and pass that directory"
        )
    return config


def config_for(source: ModelSource, preset: str, seq_len: int, tokenizer: str | None) -> Any:
    """:func:`model_config` of a run: a ``type`` preset gets as many embeddings as the
    ``--tokenizer`` has tokens (256, one per byte, without one).

    Example:
        >>> config_for(resolve_model("phi3"), "tiny", 128, None).vocab_size
        256
    """
    from .tokenizer import load_tokenizer

    vocab = VOCAB_SIZE
    if source.kind == "type" and tokenizer is not None:
        vocab = load_tokenizer(tokenizer, None).vocab_size
    return model_config(source, preset, seq_len, vocab)


def max_positions(config: Any) -> int | None:
    """The longest sequence a model's config allows (None: no bound, e.g. relative positions).

    Example:
        >>> import transformers
        >>> max_positions(transformers.GPT2Config(n_positions=64))
        64
    """
    for attr in POSITION_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model(source: ModelSource, config: Any, weights: bool = True) -> nn.Module:
    """The causal LM of a ``type`` or ``dir`` source, built with the model's own class.

    A ``type`` gets random weights. A ``dir`` is built on the meta device and, with
    ``weights``, its safetensors tensors are assigned in place of the meta ones (tied weights
    re-tied; a directory without them is an :class:`InputError`); without, it stays on the meta
    device (for a memory estimate: a directory holding only ``config.json`` will do).

    Example:
        >>> source = resolve_model("phi3")
        >>> model = load_model(source, model_config(source, "tiny", 128, 256))
    """
    import transformers as tf  # deferred: transformers takes seconds to import

    from ..initialization import init_empty_weights

    if source.kind == "dir" and weights:
        check_weights(source)
    try:
        with init_empty_weights(enable=source.kind == "dir"):
            # float32 whatever the saved dtype: the main job trains in float32
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, TypeError, ImportError, RuntimeError) as exc:
        raise InputError(
            f"--model {source.name}: transformers cannot build it ({type(exc).__name__}: {exc})"
        ) from exc
    if source.kind == "dir" and weights:
        model = _load_weights(model, source)
    return model


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (one, or those its index lists)."""
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        return [path / WEIGHTS]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"--model {path}: cannot read {index} ({type(exc).__name__}: {exc}); "
            "save the model again with save_pretrained"
        ) from exc
    return [path / name for name in sorted(set(weight_map.values()))]


def _load_weights(model: nn.Module, source: ModelSource) -> nn.Module:
    """Assign the directory's tensors to the meta model, cast to its dtypes; returns it.

    Names that do not match the model's (a checkpoint in an older layout that transformers
    converts on load) fall back to ``from_pretrained``, which loads on the meta device too.
    """
    import safetensors.torch
    from safetensors import SafetensorError

    assert source.path is not None
    live = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(source.path):
        try:
            tensors = safetensors.torch.load_file(str(file))
        except (OSError, SafetensorError) as exc:
            raise InputError(
                f"--model {source.name}: cannot read {file} ({exc}); save the "
                "model again with save_pretrained"
            ) from exc
        for key, value in tensors.items():
            state[key] = value.to(live[key].dtype) if key in live else value
    if set(state) - set(live):
        return _from_pretrained(model, source)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # the tied copies (lm_head) were not saved: point them at the loaded ones
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise InputError(
            f"--model {source.name}: its weights lack {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}; save the whole model with "
            "save_pretrained"
        )
    return model


def _from_pretrained(model: nn.Module, source: ModelSource) -> nn.Module:
    """The model loaded by transformers (which converts older layouts), in float32."""
    import transformers as tf

    try:
        loaded = tf.AutoModelForCausalLM.from_pretrained(
            str(source.path), config=model.config, dtype=torch.float32
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise InputError(
            f"--model {source.name}: its weights do not fit its config "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return loaded
