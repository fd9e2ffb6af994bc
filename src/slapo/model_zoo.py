"""Every transformers causal-LM architecture, tiny and random, and checks that Slapo schedules it
without changing what it computes.

Each check builds a tiny model of one ``model_type`` (2 layers, hidden 64, vocabulary 128, every
dropout off), trains one step of it unscheduled and one step of it scheduled, from the same
weights on the same batch, and compares the loss and the gradient of every parameter (by name).
The verdict is a :class:`CheckResult`:

* ``"equal"``: loss and every gradient close (``rtol`` 1e-4, ``atol`` 1e-5; ``max_diff`` is the
  largest absolute difference seen);
* ``"different"``: a number is wrong; ``detail`` names the worst parameter (the worst outcome: a
  schedule that trains a different model without saying so);
* ``"refused"``: Slapo declined with a typed error (:class:`~slapo.exceptions.SlapoError`), e.g.
  no ready schedule for the type, or a module its tracer cannot capture;
* ``"error"``: anything else raised (``detail``: the exception type and its first line);
* ``"n/a"``: the check does not apply, e.g. the unscheduled model itself does not train.

The same functions serve a user's own model type (any key of transformers' causal-LM mapping,
including ones registered with ``AutoModelForCausalLM.register``):

Example:
    >>> from slapo import model_zoo
    >>> model_zoo.check_eager("phi3").status
    'equal'
    >>> model_zoo.check_schedule("llama", ckpt_ratio=1.0)
    CheckResult(status='equal', detail='loss and 21 gradients', max_diff=0.0)
    >>> model_zoo.check_trace("qwen3").status      # first block traced, two input shapes
    'equal'

``benchmarks/model_coverage.py`` runs every architecture through these checks and writes the table
``docs/model_coverage.md``.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .exceptions import SlapoError

__all__ = [
    "STATUSES",
    "CheckResult",
    "ZooError",
    "causal_lm_types",
    "check_eager",
    "check_schedule",
    "check_tp",
    "check_trace",
    "compare_grads",
    "has_hf_tp_plan",
    "sample_batch",
    "tiny_config",
    "tiny_model",
    "train_step",
]

#: Every verdict a check gives, best first (``worst`` orders them by :data:`SEVERITY`).
STATUSES = ("equal", "refused", "n/a", "error", "different")
#: How bad a verdict is; the worse of two ranks' verdicts is the job's.
SEVERITY = {"equal": 0, "n/a": 1, "refused": 2, "error": 3, "different": 4}
#: Tolerances of "equal" (float32, one training step of a tiny model).
#: The transformers release whose config classes the per-type overrides below were written for
#: (older releases name some fields otherwise; their tiny configs are best effort).
CONFIGS_WRITTEN_FOR = "5.24"
RTOL, ATOL = 1e-4, 1e-5
#: Float32 sums taken in another order (the ranks' partial gradients, another kernel) differ by
#: a few units of the largest term: each element may also be off by this share of the tensor's
#: largest magnitude (Gemma's scaled, tied embedding: 3e-5 of it under TP; 4e-9 in float64).
SCALE_TOL = 1e-4

#: The sizes every tiny model has, under the usual transformers names.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "use_cache": False,
}
#: Sizes some types take and others lack, set where the config's constructor takes them: grouped
#: queries, a few small experts, small low-rank attention projections (DeepSeek's MLA), one
#: expert group, the first block dense and the second a mixture of experts.
TINY_OPTIONAL: dict[str, Any] = {
    "num_key_value_heads": 2,
    # encoder-decoder families' names (BART, ...) and others' layer counts
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "ffn_dim": 128,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # Mamba-2 mixers of hybrid models (8 heads of 16 = expand 2 x hidden 64), small states
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_chunk_size": 8,
    # a head of the vocabulary's size (Inkling pads its embedding past the head)
    "unpadded_vocab_size": 128,
    # no pad id (some types default to one beyond a small vocabulary, which nn.Embedding
    # refuses as padding_idx); bos/eos the first token
    "pad_token_id": None,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
#: RoBERTa-style position ids count from the pad id, so a real one (the types' default, 1).
_PAD_1 = {"pad_token_id": 1}
#: Multi-head latent attention expands its one latent to every head (as many key/value heads as
#: query heads); a small indexer (DeepSeek sparse attention) picking 8 of the 16 keys.
_MLA_INDEXED = {"num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}
#: dots3's text model: indexed MLA, a small shared expert.
_DOTS3_TEXT = {**_MLA_INDEXED, "shared_experts_intermediate_size": 32}
#: Gemma 4's text model: one sliding and one full attention layer (a small head dim for the
#: full one), pad id 0 (the multimodal forward writes it over non-text tokens); tiny per-layer
#: inputs where it has them (default a 262144 x 256 embedding a layer).
_GEMMA4_TEXT = {
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 8,
    "global_head_dim": 32,
    "pad_token_id": 0,
}
_GEMMA4_PER_LAYER = {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16}
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_DRAFTER = (
    "a speculative-decoding drafter: it runs on the target model's embeddings and key/value "
    "states (inputs_embeds, shared_kv_states), not on token ids"
)

#: Per-type constructor arguments on top of the usual sizes (they win over them), where a type
#: names its sizes differently or constrains them; a dict for a sub-config (``text_config``)
#: updates its tiny sizes. The comment on each says why.
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # position ids from input_ids != pad id: the types' own pad id
    "camembert": _PAD_1,
    "data2vec-text": _PAD_1,
    "roberta": _PAD_1,
    "roberta-prelayernorm": _PAD_1,
    "xlm-roberta": _PAD_1,
    "xlm-roberta-xl": _PAD_1,
    "modernbert-decoder": _PAD_1,  # a pad id it requires (an int)
    # ... and a language for its adapters (else it asks for set_default_language)
    "xmod": {**_PAD_1, "default_language": "en_XX"},
    # lengths counted from its pad index; causal attention (a causal LM)
    "xlm": {"pad_token_id": 2, "causal": True},
    # rotary dims (default 64) within the 16-wide heads
    "codegen": {"rotary_dim": 16},
    "gptj": {"rotary_dim": 16},
    # MLA with DeepSeek sparse attention's indexer
    "axk2": _MLA_INDEXED,
    "deepseek_v32": _MLA_INDEXED,
    "glm_moe_dsa": _MLA_INDEXED,
    "dots3_note_text": _DOTS3_TEXT,
    # the multimodal config: tiny text model, and adapters into its width
    "dots3_note": {
        "text_config": _DOTS3_TEXT,
        "vision_config": {
            "mlp_layer_types": ["dense", "sparse"],  # not the 42-layer expert pyramid
            "adapter_in_dim": 64,
            "adapter_out_dim": 64,
        },
        "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64},
    },
    # MLA's rotary embedding reads head_dim: the rope part of the heads
    "longcat_flash": {"head_dim": 8, "zero_expert_num": 2},
    # one global and one local layer (attention_types lists one entry per layer)
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    # mamba heads * head_dim == expand * hidden (2 * 64), groups dividing the heads
    "mamba2": {"num_heads": 8, "n_groups": 1, "state_size": 16, "chunk_size": 8},
    "nemotron_h": {
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "ssm_state_size": 16,
        "chunk_size": 8,
        "moe_shared_expert_intermediate_size": 32,
    },
    # small Kimi delta attention heads (default 32 of 128)
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16},
    # its Mamba width (default 1024) = the 8 Mamba heads of 16
    "falcon_h1": {"mamba_d_ssm": 128},
    # a layer type per layer; Zamba's shared transformer is tied across >= 2 hybrid layers
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_kv_shared_layers": 0,  # (default 15) no layer reuses another's keys and values
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
    },
    # rope parameters by layer type
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "rope_parameters": {
            "sliding_attention": {**_ROPE, "mrope_section": [4, 2, 2]},
            "full_attention": {**_ROPE, "mrope_section": [4, 2, 2]},
        },
    },
    # ZAYA routes each token to one expert only
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 32},
    # small shape and pronunciation embeddings (default 24858 x 512 and 910 x 768)
    "roc_bert": {
        "shape_vocab_size": 128,
        "shape_embed_dim": 16,
        "pronunciation_vocab_size": 128,
        "pronunciation_embed_dim": 16,
    },
    # sizes under the encoder/decoder names
    "prophetnet": {
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "num_decoder_attention_heads": 4,
        "pad_token_id": 0,  # its position ids count from the pad id
    },
    # two layers, chunks and axial positions (4 x 4 = the 16 tokens a batch has) of its size
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "attention_head_size": 16,
        "feed_forward_size": 128,
        "axial_pos_shape": [4, 4],
        "axial_pos_embds_dim": [32, 32],
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "num_buckets": 2,
        "hash_seed": 0,
        "is_decoder": True,
    },
    # one layer per stack (L, H), H_cycles=2 times over: num_hidden_layers becomes 4
    "hrm_text": {"num_hidden_layers": 1, "H_cycles": 2, "L_cycles": 1},
    # the local encoder/decoder talk to a 64-wide global transformer; few byte-hash embeddings
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_hash_byte_group_size": [3, 4],
        "encoder_config": {"hidden_size_global": 64},
        "decoder_config": {"hidden_size_global": 64},
    },
    # its text config requires an int pad id
    "emu3": {"text_config": {"pad_token_id": 1}},
    # the attention reads rope_theta and clips q/k/v (a None clip fails); small experts
    "dbrx": {
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_top_k": 2},
    },
    "gemma4_text": {**_GEMMA4_TEXT, **_GEMMA4_PER_LAYER},
    # the multimodal Gemma 4s: tiny text models, small vision/audio towers
    "gemma4": {
        "text_config": {**_GEMMA4_TEXT, **_GEMMA4_PER_LAYER},
        "vision_config": {"position_embedding_size": 64},
        "audio_config": {"output_proj_dims": 64},
    },
    "gemma4_unified": {
        "text_config": _GEMMA4_TEXT,
        "vision_config": {"mm_embed_dim": 64, "mm_posemb_size": 64, "output_proj_dims": 64},
        "audio_config": {"audio_embed_dim": 64},
    },
    # GIT's image: 8 x 8 pixels in 4 x 4 patches (sample_batch gives one)
    "git": {"vision_config": {"image_size": 8, "patch_size": 4}},
    # 2 codebooks; pad/bos the extra embedding row past the vocabulary, as by default
    "musicgen": {"decoder": {"num_codebooks": 2, "pad_token_id": 128, "bos_token_id": 128}},
    "musicgen_melody": {"decoder": {"num_codebooks": 2, "pad_token_id": 128, "bos_token_id": 128}},
}
#: Types transformers lists as causal LMs whose model does not train on a batch of token ids:
#: why (:func:`tiny_model` raises a :class:`ZooError` saying it; the checks give ``"n/a"``).
NOT_TOKEN_LMS: dict[str, str] = {
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
}
#: Types whose causal-LM class takes a sub-config of the type's config: its name.
TINY_CAUSAL_LM_PART: dict[str, str] = {
    # MusicgenForCausalLM is the audio-code decoder alone (text and audio encoders aside)
    "musicgen": "decoder",
    "musicgen_melody": "decoder",
}
#: Types whose ``num_hidden_layers`` counts sub-layers (two or four of them make the two-block
#: model): the count their tiny config has instead of 2.
TINY_LAYER_COUNTS: dict[str, int] = {
    # each decoder layer holds two attention sub-layers: num_hidden_layers is 2 * num_layers
    "longcat_flash": 4,
    # each layer is one mixer: mamba, mixture of experts, attention, MLP (the default pattern)
    "nemotron_h": 4,
    # one layer per stack (L and H), run H_cycles * (L_cycles + 1) = 4 times: a cache slot each
    "hrm_text": 4,
}

#: Substrings of the config attributes that make training random; each is set to 0 (0.0, or
#: 0 where the field is an int).
RANDOM_ATTRS = ("dropout", "pdrop", "layerdrop")
#: Parameter-name segments that wrappers add (``torch.compile``, checkpoint wrappers); dropped
#: when gradients are matched by name.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


class ZooError(SlapoError):
    """transformers cannot make a tiny config or model of a model type."""


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one check.

    Attributes:
        status: one of :data:`STATUSES`: ``"equal"``, ``"different"``, ``"refused"``,
            ``"error"`` or ``"n/a"``.
        detail: what was compared, or why it is not equal (the worst parameter, the exception).
        max_diff: the largest absolute difference of the loss or a gradient; None when nothing
            was compared.

    Example:
        >>> CheckResult("refused", "SlapoError: no ready schedule for model type 'phi3'")
        CheckResult(status='refused', detail="SlapoError: ...", max_diff=None)
    """

    status: str
    detail: str = ""
    max_diff: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CheckResult status must be one of {STATUSES}, got {self.status!r}")

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict.

        Example:
            >>> CheckResult("equal", "loss", 0.0).as_dict()
            {'status': 'equal', 'detail': 'loss', 'max_diff': 0.0}
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> CheckResult:
        """The inverse of :meth:`as_dict`."""
        return cls(doc["status"], doc.get("detail", ""), doc.get("max_diff"))


def worst(results: list[CheckResult]) -> CheckResult:
    """The most severe of ``results`` (:data:`SEVERITY`); the first of equally severe ones.

    Example:
        >>> worst([CheckResult("equal"), CheckResult("error", "boom")]).status
        'error'
    """
    return max(results, key=lambda r: SEVERITY[r.status])


# --- tiny models ---------------------------------------------------------------------------------


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


def _codebook_batch(
    config: Any, batch: int, seq: int, draw: Callable[..., torch.Tensor], generator: Any
) -> dict[str, torch.Tensor]:
    """MusicGen's decoder: ``num_codebooks`` streams of audio codes a sample, the ids as
    ``(batch * num_codebooks, seq)`` and the labels as ``(batch, seq, num_codebooks)``."""
    codes = draw(batch, config.num_codebooks, seq)
    return {"input_ids": codes.reshape(-1, seq), "labels": codes.transpose(1, 2).contiguous()}


def _image_batch(
    config: Any, batch: int, seq: int, draw: Callable[..., torch.Tensor], generator: Any
) -> dict[str, torch.Tensor]:
    """GIT: its loss skips the logits of the image tokens, so each sample has an image too."""
    ids = draw(batch, seq)
    vision = config.vision_config
    shape = (batch, vision.num_channels, vision.image_size, vision.image_size)
    pixels = torch.randn(shape, generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "pixel_values": pixels}


#: Batches of another layout than ``input_ids`` and ``labels`` of ``(batch, seq)``, by the
#: ``model_type`` of the built model's config: ``(config, batch, seq, draw, generator)`` to the
#: batch, ``draw(*shape)`` giving random token ids.
BATCH_LAYOUTS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "musicgen_decoder": _codebook_batch,
    "musicgen_melody_decoder": _codebook_batch,
    "git": _image_batch,
}


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


# --- comparison ----------------------------------------------------------------------------------


def _excess(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and how far the worst element is beyond the
    tolerance (> 0: not close; inf where a value is not finite in one of them only)."""
    got, want = got.detach().double(), want.detach().double()
    if got.numel() == 0:
        return 0.0, -1.0
    same_nonfinite = (~torch.isfinite(got)) & (got == want)
    diff = torch.where(same_nonfinite, torch.zeros_like(got), (got - want).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    magnitude = want.abs().nan_to_num(nan=0.0, posinf=0.0)
    excess = diff - (ATOL + RTOL * magnitude + SCALE_TOL * magnitude.max())
    return float(diff.max()), float(excess.max())


def compare_grads(
    ref_loss: torch.Tensor,
    loss: torch.Tensor,
    want: Mapping[str, torch.Tensor | None],
    grads: Mapping[str, torch.Tensor | None],
) -> CheckResult:
    """Compare a loss and its gradients with the expected ones (rtol 1e-4, atol 1e-5):
    ``"equal"``, or ``"different"`` naming the worst parameter (or the loss).

    Example:
        >>> compare_grads(torch.tensor(1.0), torch.tensor(1.0), {"w": torch.ones(2)},
        ...               {"w": torch.ones(2)})
        CheckResult(status='equal', detail='loss and 1 gradients', max_diff=0.0)
    """
    if set(want) != set(grads):
        missing, extra = sorted(set(want) - set(grads)), sorted(set(grads) - set(want))
        return CheckResult(
            "different", f"parameter names differ: missing {missing[:3]}, extra {extra[:3]}"
        )
    max_diff, excess = _excess(loss.reshape(()), ref_loss.reshape(()))
    if excess > 0:
        return CheckResult(
            "different", f"loss {float(loss):.6g} vs {float(ref_loss):.6g}", max_diff
        )
    bad: list[tuple[float, str, str]] = []
    for name, expected in want.items():
        got = grads[name]
        if expected is None or got is None:
            if (expected is None) != (got is None):
                which = "no gradient" if got is None else "a gradient where the reference has none"
                bad.append((math.inf, name, which))
            continue
        if got.shape != expected.shape:
            bad.append((math.inf, name, f"shape {tuple(got.shape)} vs {tuple(expected.shape)}"))
            continue
        diff, over = _excess(got, expected)
        max_diff = max(max_diff, diff)
        if over > 0:
            bad.append((diff, name, f"off by {diff:.3g}"))
    if bad:
        diff, name, why = max(bad)
        return CheckResult(
            "different",
            f"gradient of {name}: {why} ({len(bad)} of {len(want)} outside rtol {RTOL:g}, "
            f"atol {ATOL:g}, {SCALE_TOL:g} of the largest)",
            max_diff,
        )
    return CheckResult("equal", f"loss and {len(want)} gradients", max_diff)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _failure(exc: BaseException, where: str = "") -> CheckResult:
    """A raised exception as a result: a Slapo refusal, or an error."""
    status = "refused" if isinstance(exc, SlapoError) else "error"
    return CheckResult(status, f"{where}{_describe(exc)}")


def _reference(
    model_type: str, shapes: tuple[tuple[int, int], ...] = ((2, 16),)
) -> tuple[nn.Module, list[dict[str, torch.Tensor]], list[tuple[Any, Any]]] | CheckResult:
    """The tiny model, a batch per ``(batch, seq)`` shape, and the unscheduled loss and
    gradients on each; an ``"n/a"`` result when the unscheduled model does not train."""
    try:
        model = tiny_model(model_type)
        batches = [sample_batch(model, b, s) for b, s in shapes]
        ref = copy.deepcopy(model)
        outs = [train_step(ref, batch) for batch in batches]
    except Exception as exc:  # noqa: BLE001  (reported)
        return CheckResult("n/a", f"does not train unscheduled: {_describe(exc)}")
    if not all(torch.isfinite(loss) for loss, _ in outs):
        return CheckResult("n/a", "does not train unscheduled: loss is not finite")
    return model, batches, outs


def _compare_runs(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    outs: list[tuple[Any, Any]],
    shapes: tuple[tuple[int, int], ...],
    expected: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> CheckResult:
    """Train ``model`` one step per batch and compare with the reference ``outs``."""
    results = []
    for (b, s), batch, (ref_loss, ref_grads) in zip(shapes, batches, outs):
        where = f"batch {b} x seq {s}: " if len(shapes) > 1 else ""
        try:
            loss, grads = train_step(model, batch)
        except Exception as exc:  # noqa: BLE001  (reported)
            return _failure(exc, where)
        want = ref_grads
        if expected is not None:
            want = {n: None if g is None else expected(n, g) for n, g in ref_grads.items()}
        result = compare_grads(ref_loss, loss, want, grads)
        if result.status != "equal":
            return CheckResult(result.status, where + result.detail, result.max_diff)
        results.append(result)
    diffs = [r.max_diff for r in results if r.max_diff is not None]
    shown = ", ".join(f"{b}x{s}" for b, s in shapes)
    detail = results[0].detail + (f" at {shown}" if len(shapes) > 1 else "")
    return CheckResult("equal", detail, max(diffs) if diffs else None)


# --- the checks ----------------------------------------------------------------------------------


def check_eager(model_type: str) -> CheckResult:
    """The unscheduled tiny model trains one step (finite loss, backward reaches the
    parameters) and a second run from a copy gives the same loss and gradients: ``"equal"``.
    A model whose two runs differ (so no schedule can be compared with it) is
    ``"different"``; one that fails is ``"error"``; ``"n/a"`` when transformers cannot make a
    tiny model of it (:class:`ZooError`).

    Example:
        >>> check_eager("llama").status
        'equal'
    """
    try:
        model = tiny_model(model_type)
    except ZooError as exc:
        return CheckResult("n/a", _describe(exc))
    try:
        batch = sample_batch(model)
        twin = copy.deepcopy(model)
        loss, grads = train_step(model, batch)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    if not torch.isfinite(loss):
        return CheckResult("error", f"loss is not finite ({float(loss)})")
    if not any(g is not None for g in grads.values()):
        return CheckResult("error", "backward reached no parameter")
    try:
        loss2, grads2 = train_step(twin, batch)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc, "second run: ")
    result = compare_grads(loss, loss2, grads, grads2)
    if result.status != "equal":
        return CheckResult(result.status, "not deterministic: " + result.detail, result.max_diff)
    return CheckResult("equal", f"loss {float(loss):.4f}; {result.detail}", result.max_diff)


def check_schedule(model_type: str, **knobs: Any) -> CheckResult:
    """``slapo.model_schedule.apply_schedule(model, **knobs)`` (no knobs: the recommended
    schedule), built with ``slapo.build(sch, init_weights=False)``, trains one step like the
    unscheduled model: the loss and every gradient compared.

    Example:
        >>> check_schedule("llama", ckpt_ratio=1.0).status
        'equal'
        >>> check_schedule("gemma4_assistant").status     # a drafter: no token-id batch
        'n/a'
    """
    from . import build
    from .model_schedule import apply_schedule

    ref = _reference(model_type)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    try:
        sch = apply_schedule(copy.deepcopy(model), **knobs)
        scheduled, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    return _compare_runs(scheduled, batches, outs, ((2, 16),))


#: The input shapes ``check_trace`` compares at: the one traced with and another.
TRACE_SHAPES = ((2, 16), (3, 9))


def check_trace(model_type: str) -> CheckResult:
    """The first decoder block (``slapo.train.generic.find_blocks``) traced with no example inputs
    (``sch[block].trace()``), built, trains one step like the unscheduled model at batch 2 x
    seq 16 and at batch 3 x seq 9: a traced graph must not be specialised to one shape.

    Example:
        >>> check_trace("llama")
        CheckResult(status='equal', detail='loss and 21 gradients at 2x16, 3x9', max_diff=0.0)
    """
    from . import build
    from .schedule import create_schedule
    from .train.generic import find_blocks

    ref = _reference(model_type, TRACE_SHAPES)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    blocks, _ = find_blocks(model)
    if not blocks:
        return CheckResult("n/a", "no repeated blocks found")
    block = _first_decoder_block(model, blocks, batches[0]["input_ids"])
    try:
        sch = create_schedule(copy.deepcopy(model))
        sch[block].trace()
        traced, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc, f"trace {block}: ")
    return _compare_runs(traced, batches, outs, TRACE_SHAPES)


def _first_decoder_block(model: nn.Module, blocks: list[str], input_ids: torch.Tensor) -> str:
    """The first of ``blocks`` a run on token ids alone calls (a multimodal model's vision
    blocks come first in the module tree but never see token ids), else the first such member of
    a list of like composite modules (GIT keeps only its vision layers whole); else the first
    block."""
    lists = [
        f"{path}.{name}"
        for path, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len({type(c) for c in mod.children()}) == 1
        for name, child in mod._modules.items()
        if child is not None and any(True for _ in child.children())
    ]
    for candidates in (blocks, [p for p in lists if p not in blocks]):
        called = _called_first(model, candidates, input_ids)
        if called is not None:
            return called
    return blocks[0]


def _called_first(model: nn.Module, paths: list[str], input_ids: torch.Tensor) -> str | None:
    """The first of ``paths`` a run of ``model`` on ``input_ids`` calls, or None."""
    called: list[str] = []
    handles = [
        model.get_submodule(p).register_forward_pre_hook(lambda *_, p=p: called.append(p))
        for p in paths
    ]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    except Exception:  # noqa: BLE001  (the model needs more than token ids)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return called[0] if called else None


def has_hf_tp_plan(model_type: str) -> bool:
    """Whether transformers ships a tensor-parallel plan (a non-empty ``base_model_tp_plan``)
    for ``model_type`` (on its config or its text sub-config).

    Example:
        >>> has_hf_tp_plan("llama"), has_hf_tp_plan("gpt2")
        (True, False)
    """
    try:
        config_class = _config_class(model_type)
    except ZooError:
        return False
    if getattr(config_class, "base_model_tp_plan", None):
        return True
    for sub_class in (getattr(config_class, "sub_configs", None) or {}).values():
        if inspect.isclass(sub_class) and getattr(sub_class, "base_model_tp_plan", None):
            return True
    return False


def check_tp(model_type: str, group: Any, **knobs: Any) -> CheckResult:
    """Tensor parallelism over ``group`` (run it on every rank of an initialised process
    group): ``apply_schedule(model, group=group, ckpt_ratio=0.0, **knobs)``, built, against the
    same model in this process without a group. A sharded parameter's gradient is compared
    with its slice of the full one (``get_shard_spec(p).local_slice``), a replicated
    parameter's with the whole one. The ranks exchange their verdicts: every rank returns the
    worst. ``detail`` says "nothing sharded" when the plan sharded no parameter.

    Example (in each of 2 ranks, after ``slapo.env.setup(rank, 2, "gloo")``):
        >>> check_tp("llama", torch.distributed.group.WORLD).status
        'equal'
    """
    local = _check_tp_local(model_type, group, knobs)
    return _agree(local, group)


def _check_tp_local(model_type: str, group: Any, knobs: dict[str, Any]) -> CheckResult:
    from . import build
    from .model_schedule import apply_schedule
    from .sharding import get_shard_spec

    ref = _reference(model_type)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    try:
        sch = apply_schedule(copy.deepcopy(model), group=group, **{"ckpt_ratio": 0.0, **knobs})
        sharded, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    specs = {_clean_name(n): get_shard_spec(p) for n, p in sharded.named_parameters()}

    def expected(name: str, full: torch.Tensor) -> torch.Tensor:
        spec = specs.get(name)
        return full if spec is None else spec.local_slice(full)

    result = _compare_runs(sharded, batches, outs, ((2, 16),), expected)
    count = sum(spec is not None for spec in specs.values())
    note = f"; {count} sharded" if count else "; nothing sharded"
    return CheckResult(result.status, result.detail + note, result.max_diff)


def _agree(local: CheckResult, group: Any) -> CheckResult:
    """Every rank's verdict gathered: the worst, naming the rank when they differ."""
    import torch.distributed as dist

    try:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local.as_dict(), group=group)
    except Exception as exc:  # noqa: BLE001  (reported)
        return CheckResult(
            "error", f"ranks could not exchange verdicts ({_describe(exc)}); {local.detail}"
        )
    results = [CheckResult.from_dict(doc) for doc in gathered]
    bad = worst(results)
    if all(r.status == results[0].status for r in results):
        diffs = [r.max_diff for r in results if r.max_diff is not None]
        return CheckResult(bad.status, bad.detail, max(diffs) if diffs else None)
    rank = results.index(bad)
    return CheckResult(bad.status, f"rank {rank}: {bad.detail}", bad.max_diff)
