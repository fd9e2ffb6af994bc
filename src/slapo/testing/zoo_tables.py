"""The model zoo's per-type tables: what is peculiar to each transformers ``model_type``.

Every tiny model has the sizes :data:`TINY_SIZES` (and :data:`TINY_OPTIONAL` where its config
takes them); the other tables name, type by type, what a type needs on top: other constructor
arguments (:data:`TINY_OVERRIDES`), a layer count (:data:`TINY_LAYER_COUNTS`), a sub-config its
causal-LM class is built from (:data:`TINY_CAUSAL_LM_PART`), a batch of another layout
(:data:`BATCH_LAYOUTS`), or why it cannot train on token ids (:data:`NOT_TOKEN_LMS`). Adding a
model type that needs a fix touches this module only; :mod:`slapo.testing.zoo_models` reads it.

Example:
    >>> from slapo.testing.zoo_tables import TINY_OVERRIDES, TINY_SIZES
    >>> TINY_SIZES["hidden_size"], TINY_OVERRIDES["gptj"]
    (64, {'rotary_dim': 16})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The transformers release whose config classes the per-type overrides below were written for
#: (older releases name some fields otherwise; their tiny configs are best effort).
CONFIGS_WRITTEN_FOR = "5.24"

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
