"""slapo.throughput: model FLOPs per token (hand counts; a config against its model), the GPU
peak table's lookup by name, MFU, and the module's docstring examples."""

from __future__ import annotations

import doctest

import pytest
import torch
import transformers as tf

import slapo.throughput
from slapo.throughput import (
    PEAK_TFLOPS,
    device_peak_tflops,
    mfu,
    model_flops_per_token,
    peak_tflops_of,
)


def _llama_config(**overrides) -> tf.LlamaConfig:
    fields = dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, vocab_size=300, tie_word_embeddings=False,
    )  # fmt: skip
    return tf.LlamaConfig(**{**fields, **overrides})


def test_a_tiny_llama_config_counts_as_by_hand():
    cfg = _llama_config()
    # q: 64 -> 4 heads x 24; k, v: 64 -> 2 x 24; o: 96 -> 64; gate, up, down: 64 <-> 160
    per_layer = 64 * 96 + 2 * 64 * 48 + 96 * 64 + 3 * 64 * 160
    weights = 3 * per_layer + 300 * 64  # and the LM head; the embeddings are no matmul
    attention = 3 * 4 * 24  # layers x heads x head width
    assert model_flops_per_token(cfg, 32) == 6 * weights + 12 * attention * 32
    assert model_flops_per_token(cfg, 32, training=False) == 2 * weights + 4 * attention * 32


@pytest.mark.parametrize("tied", [False, True])
def test_the_module_count_agrees_with_the_config_count(tied):
    cfg = _llama_config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    assert model_flops_per_token(model, 128) == model_flops_per_token(cfg, 128)
    # a tied LM head still multiplies every token by the embedding matrix
    assert model_flops_per_token(cfg, 128) == model_flops_per_token(_llama_config(), 128)


def test_a_module_without_config_has_no_attention_term():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    assert model_flops_per_token(mlp, 1024) == 6 * (8 * 16 + 16 * 4)


def test_gpt2_falls_back_to_counting_its_conv1d_modules():
    cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    per_layer = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32  # c_attn, c_proj, c_fc, mlp c_proj
    expected = 6 * (2 * per_layer + 100 * 32) + 12 * 2 * 32 * 64
    assert model_flops_per_token(cfg, 64) == expected
    assert model_flops_per_token(tf.GPT2LMHeadModel(cfg), 64) == expected


def test_qwen3_moe_counts_only_the_active_experts():
    cfg = tf.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    moe = 3 * 64 * (2 * 32) + 64 * 8  # two 32-wide experts of eight, and the router
    expected = 6 * (2 * (attention + moe) + 100 * 64) + 12 * 2 * 64 * 10
    assert model_flops_per_token(cfg, 10) == expected
    with torch.device("meta"):
        model = tf.Qwen3MoeForCausalLM(cfg)
    assert model_flops_per_token(model, 10) == expected
    # a layer listed in mlp_only_layers is dense: intermediate_size wide
    cfg.mlp_only_layers = [1]
    dense = 3 * 64 * 256
    assert model_flops_per_token(cfg, 10) == expected + 6 * (dense - moe)


def test_mixtral_experts_are_intermediate_size_wide():
    cfg = tf.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    expected_weights = 4 * 64 * 64 + 3 * 64 * 2 * 96 + 64 * 4 + 100 * 64
    assert model_flops_per_token(cfg, 8) == 6 * expected_weights + 12 * 64 * 8


@pytest.mark.parametrize(
    "name, row",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A800-SXM4-80GB", "A800"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA L40S", "L40S"),
    ],
)
def test_gpu_names_find_their_row(name, row):
    for precision, value in PEAK_TFLOPS[row].items():
        assert peak_tflops_of(name, precision) == value
    assert peak_tflops_of(name, "bfloat16") == PEAK_TFLOPS[row]["bf16"]


def test_unknown_gpus_and_precisions_have_no_peak():
    assert peak_tflops_of("Tesla T4", "fp16") is None
    assert peak_tflops_of("NVIDIA L40", "bf16") is None  # not the L40S
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_tflops_of("NVIDIA H100 80GB HBM3", "int4") is None


def test_the_table_is_dense_and_consistent():
    assert peak_tflops_of("NVIDIA H100 80GB HBM3", "bf16") == 989.5  # 1979 with sparsity
    for row, peaks in PEAK_TFLOPS.items():
        assert peaks["bf16"] == peaks["fp16"], row
        # each step down in width doubles the tensor-core rate (within the datasheets' rounding)
        assert peaks["bf16"] == pytest.approx(2 * peaks["tf32"], rel=0.02), row
        if "fp8" in peaks:
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.02), row
        assert peaks["fp32"] <= peaks["tf32"], row


def test_no_peak_on_the_cpu():
    assert device_peak_tflops("cpu", "bf16") is None
    assert device_peak_tflops(torch.device("cpu"), "fp32") is None


def test_mfu_arithmetic():
    # 2,000 tokens/s x 7 GFLOPs = 14 TFLOPS of 2 x 70 TFLOPS
    assert mfu(2000, 7e9, 70.0, num_devices=2) == pytest.approx(0.1)
    assert mfu(2000, 7e9, None) is None
    assert mfu(0, 7e9, 70.0) == 0.0


def test_docstring_examples():
    result = doctest.testmod(slapo.throughput, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
