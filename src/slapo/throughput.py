"""Throughput the way people compare it: model FLOPs per token, GPU peaks, and MFU.

Model FLOPs utilization (MFU) is the throughput a run reaches over the hardware's peak, counting
only the FLOPs the model needs (PaLM, Chowdhery et al. 2022, appendix B), not what the run spends
on top (activation recompute, padding): a checkpointed schedule does more work at the same MFU.

The count per token is torchtitan's (``get_num_flop_per_token``: ``6 * N + 12 * l * h * q * t``):

* ``6 * N``: ``N`` is the number of weights that a token multiplies in the matmuls (a
  multiply-add is 2 FLOPs; the backward pass costs twice the forward, for the gradients of the
  inputs and of the weights). The LM head counts, tied to the embeddings or not; the embedding
  lookups do not (no arithmetic), nor do biases and norm scales (additions, under 0.1%). A MoE
  layer counts its router and its active experts only: the ``top-k`` routed ones plus the shared
  ones.
* ``12 * l * h * q * t``: attention's two matmuls (``Q K^T`` and ``A V``), ``l`` layers, ``h``
  query heads of width ``q``, ``t = seq_len`` keys each; as in torchtitan and PaLM, not halved for
  a causal mask (the kernels skip the masked half, but the convention compares runs).

With ``training=False`` (a forward pass) the factors are 2 and 4 instead of 6 and 12.

Example:
    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192,
    ...     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
    >>> flops = model_flops_per_token(cfg, 2048)
    >>> f"{flops / 1e9:.2f} GFLOPs per token"
    '7.04 GFLOPs per token'
    >>> peak = peak_tflops_of("NVIDIA H100 80GB HBM3", "bf16")
    >>> peak
    989.5
    >>> f"{mfu(30_000, flops, peak):.1%}"
    '21.3%'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "PEAK_TFLOPS",
    "device_peak_tflops",
    "mfu",
    "model_flops_per_token",
    "peak_tflops_of",
]

#: Dense (no structured sparsity) peak TFLOPS per GPU: ``bf16``/``fp16``/``fp8`` on the tensor
#: cores, ``tf32`` (fp32 matmuls on the tensor cores, what ``torch.backends.cuda.matmul.
#: allow_tf32`` enables) and ``fp32`` (the CUDA cores, no tensor cores). Datasheets print the
#: tensor-core figures with 2:4 sparsity; the figures here are half of them.
#:
#: * H100 SXM and PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU datasheet.
#: * H200 (SXM) and H200 NVL: NVIDIA H200 Tensor Core GPU datasheet (the H200's compute is the
#:   H100 SXM's; GH200 matches the H200 row, also an H100's compute).
#: * A100 (SXM4 and PCIe, 40 and 80 GB, one row: the same peaks): NVIDIA A100 Tensor Core GPU
#:   datasheet. A800 (40/80 GB, PCIe and SXM): NVIDIA A800 datasheet, the A100's compute. No fp8.
#: * B200: NVIDIA HGX B200 specifications (the 8-GPU figures divided by 8).
#: * RTX 4090: NVIDIA Ada Lovelace GPU architecture whitepaper (appendix A), with FP32
#:   accumulation (what training's matmuls use; GeForce cards run fp16 accumulation twice as fast).
#: * L40S: NVIDIA L40S datasheet.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1125.0, "fp32": 75.0},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "tf32": 82.6, "fp32": 82.6},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
}

# (substring of torch.cuda.get_device_name, case-insensitive; row): the first match wins, so the
# variants come before the plain name ("NVIDIA H100 80GB HBM3" is the SXM part).
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    ("h100 pcie", "H100 PCIe"),
    ("h100 nvl", "H100 NVL"),
    ("h100", "H100 SXM"),
    ("h200 nvl", "H200 NVL"),
    ("h200", "H200"),
    ("a100", "A100"),
    ("a800", "A800"),
    ("b200", "B200"),
    ("rtx 4090", "RTX 4090"),
    ("l40s", "L40S"),
)

_PRECISION_ALIASES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float8": "fp8",
}  # fmt: skip

# model types whose layers are GQA attention (q, k, v, o projections of head_dim-wide heads)
# and a gated MLP (gate, up, down), dense or MoE: counted from their configs alone
_GATED_DECODERS = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma"}
)


def _precision_key(precision_name: str) -> str:
    name = precision_name.strip().lower()
    return _PRECISION_ALIASES.get(name, name)


def peak_tflops_of(name: str, precision_name: str) -> float | None:
    """The dense peak TFLOPS of the GPU called ``name`` (what ``torch.cuda.get_device_name``
    says) in ``precision_name`` (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``; or
    ``bfloat16``, ``float16``...); None for a GPU or a precision the table does not have.

    Example:
        >>> peak_tflops_of("NVIDIA H100 PCIe", "bf16"), peak_tflops_of("NVIDIA A100-SXM4-80GB", "fp32")
        (756.5, 19.5)
        >>> peak_tflops_of("NVIDIA A100-SXM4-40GB", "fp8") is None  # no fp8 on the A100
        True
    """
    lowered = name.lower()
    for pattern, row in _NAME_PATTERNS:
        if pattern in lowered:
            return PEAK_TFLOPS[row].get(_precision_key(precision_name))
    return None


def device_peak_tflops(
    device: torch.device | str | int | None, precision_name: str
) -> float | None:
    """:func:`peak_tflops_of` the CUDA ``device`` (an index, ``"cuda:0"``, None: the current
    one); None on the CPU, without CUDA or for a GPU the table does not know. ``fp32`` is read
    as ``tf32`` when torch lets float32 matmuls use TF32 (``torch.set_float32_matmul_precision``
    other than ``"highest"``, or ``torch.backends.cuda.matmul.allow_tf32``).

    Example:
        >>> device_peak_tflops("cpu", "bf16") is None
        True
    """
    if isinstance(device, str | torch.device) and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    key = _precision_key(precision_name)
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    return peak_tflops_of(torch.cuda.get_device_name(device), key)


def mfu(
    tokens_per_s: float, flops_per_token: float, peak_tflops: float | None, num_devices: int = 1
) -> float | None:
    """Model FLOPs utilization, a fraction: the FLOPs per second the tokens need over the peak
    of ``num_devices`` devices; None when the peak is not known.

    Example:
        >>> mfu(1000, 6e9, 100.0, num_devices=2)  # 6 TFLOPS of 200
        0.03
        >>> mfu(1000, 6e9, None) is None
        True
    """
    if peak_tflops is None or peak_tflops <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * num_devices)


def model_flops_per_token(model_or_config: Any, seq_len: int, *, training: bool = True) -> int:
    """The model FLOPs of one token of a ``seq_len``-token sequence (module doc: ``6 * N + 12 *
    l * h * q * t``; ``2 * N + 4 * l * h * q * t`` when not ``training``).

    From a transformers ``PretrainedConfig``: a Llama-like decoder (Llama, Mistral, Mixtral,
    Qwen2/3 and their MoE, Phi-3, Gemma) is counted from its fields (``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``head_dim``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``; MoE: ``num_experts``/``num_local_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size`` (Mixtral's experts are
    ``intermediate_size`` wide), ``decoder_sparse_step``, ``mlp_only_layers``, shared experts:
    ``shared_expert_intermediate_size`` or ``n_shared_experts``); another model type is built on
    the meta device from its config and counted as a module.

    From an ``nn.Module``: the weights of its ``nn.Linear`` and transformers ``Conv1D`` modules
    (every one runs once per token: embeddings are not among them, the LM head is); the attention
    term from its ``config`` (none without one: a model without attention). A module whose config
    has experts is counted from the config (transformers keeps the experts in 3-D parameters,
    not Linear modules, and only the top-k run per token).

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        >>> # per layer 64*(64+32+32) + 64*64 + 3*64*128 = 36864 weights; the LM head 256*64
        >>> flops = model_flops_per_token(cfg, 16)
        >>> flops == 6 * (2 * 36864 + 256 * 64) + 12 * 2 * 64 * 16
        True
        >>> model_flops_per_token(transformers.LlamaForCausalLM(cfg), 16) == flops
        True
    """
    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if config is not None and _num_experts(config):
            weights = _config_matmul_weights(config)
        else:
            weights = _module_matmul_weights(model_or_config)
    else:
        config = model_or_config
        if getattr(config, "model_type", None) in _GATED_DECODERS:
            weights = _config_matmul_weights(config)
        else:
            weights = _module_matmul_weights(_meta_model(config))
    width = 0 if config is None else _attention_width(config)
    per_weight, per_score = (6, 12) if training else (2, 4)
    return per_weight * weights + per_score * width * seq_len


def _attention_width(config: Any) -> int:
    """``l * h * q``: layers x query heads x head width (0 for a config without attention)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return 0
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
    return layers * heads * (head_dim or config.hidden_size // heads)


def _num_experts(config: Any) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def _config_matmul_weights(config: Any) -> int:
    """The matmul weights a token multiplies, from a Llama-like decoder's config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    dense_mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    experts = _num_experts(config)
    moe_mlp = dense_mlp
    if experts:
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or (
            (getattr(config, "n_shared_experts", None) or 0) * width
        )
        active = config.num_experts_per_tok * width + shared
        moe_mlp = 3 * hidden * active + hidden * experts  # the active experts and the router
        if getattr(config, "shared_expert_intermediate_size", None):
            moe_mlp += hidden  # Qwen2-MoE's shared-expert gate: Linear(hidden, 1)
    total = 0
    for layer in range(config.num_hidden_layers):
        total += attention + (moe_mlp if _is_sparse(config, layer, experts) else dense_mlp)
    return total + config.vocab_size * hidden  # the LM head


def _is_sparse(config: Any, layer: int, experts: int) -> bool:
    """Whether ``layer`` is a MoE layer (Qwen-MoE's ``decoder_sparse_step``/``mlp_only_layers``)."""
    if not experts or layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    return (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def _module_matmul_weights(model: nn.Module) -> int:
    """The weights of ``model``'s Linear and Conv1D modules (each counted once per module)."""
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    )


def _meta_model(config: Any) -> nn.Module:
    """The transformers model of ``config`` on the meta device (nothing allocated)."""
    import transformers as tf  # deferred: transformers takes seconds to import

    classes = (tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM)
    with torch.device("meta"):
        for auto in classes:
            try:
                return auto.from_config(config)
            except ValueError:  # not a model type of this auto class
                continue
        return tf.AutoModel.from_config(config)
