"""The memory planner in mixed precision: float32 master weights and optimizer state, activations
and gathered parameters in the compute dtype, each target as its engine applies it.

Measured (``precision_jobs``, :class:`slapo.train.run_memory.PeakMemory`): an eager step under
``torch.autocast`` in one process, and DDP (autocast) and FSDP2 (``MixedPrecisionPolicy(bf16,
fp32)``) on 2 gloo ranks, each within 10% of its bf16 estimate (in practice byte for byte).
Analytic: the parts of a small Llama under every target. From a config: a directory holding only
``config.json`` (``slapo estimate --model DIR``), and CUDA's reserved bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from layout_jobs import make_batch
from measure import batch
from precision_jobs import autocast_forward, data_parallel_bf16, make_llama, measure

import hf_models as H
import slapo
from dist_utils import check_all, run_workers
from slapo.cli import main
from slapo.memory import EstimateError, LayoutSpec, apply_layout, estimate_layout
from slapo.memory.units import allocator_rounding, reserved_bytes
from slapo.model_schedule import apply_schedule
from slapo.precision import Precision

SCHEDULES = {
    "plain": {"ckpt_ratio": 0.0},
    "half selective, sdpa": {"ckpt_ratio": 0.5, "ckpt_policy": "save_matmuls", "attn_op": "sdpa"},
    "all full, fused loss": {"ckpt_ratio": 1.0, "fused_loss": True},
}


def _within(estimate: int, measured: int, rel: float = 0.10) -> bool:
    return abs(estimate - measured) <= rel * measured


def _numel(params: object) -> list[int]:
    return [p.numel() for p in params]


def _linear_weights(model: torch.nn.Module, size: int) -> int:
    """Bytes of the weights of every linear layer (GPT-2's ``Conv1D`` too) at ``size`` each."""
    kinds = ("Linear", "Conv1D")
    return sum(size * m.weight.numel() for m in model.modules() if type(m).__name__ in kinds)


# ----- measured: eager under autocast, DDP and FSDP2 on gloo ranks -------------------------------
# every schedule in bf16; fp16 autocasts alike (plus a loss scaler: no tensor of note)
EAGER_CASES = [
    *((family, schedule, "bf16") for family in ("llama", "gpt2") for schedule in SCHEDULES),
    ("llama", "plain", "fp16"), ("gpt2", "plain", "fp16"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "schedule", "precision"), EAGER_CASES)
def test_eager_autocast_within_10_percent(family, schedule, precision):
    model = H.make(family)
    sch = apply_schedule(model, **SCHEDULES[schedule])
    data = batch(H.VOCAB)
    est = slapo.estimate_memory(sch, data, precision=precision)
    fp32 = slapo.estimate_memory(sch, data)
    real = measure(model, data, autocast_forward(model, Precision.of(precision)))
    assert est.precision == precision and real["grad_dtype"] == "torch.float32"
    # float32 master weights: parameters, gradients and AdamW state as in fp32, exactly
    assert (est.params, est.grads) == (real["params"], real["grads"]) == (fp32.params, fp32.grads)
    assert est.optimizer_state == real["optimizer_state"] == fp32.optimizer_state
    assert _within(est.activations, real["activations"]), (est.activations, real["activations"])
    assert _within(est.peak, real["peak"]), (est.peak, real["peak"])
    if schedule != "all full, fused loss":  # which keeps only the blocks' float32 inputs
        assert real["activations"] < 0.95 * fp32.activations  # the measured run is in 16 bits
    if schedule == "plain":  # every linear weight's 16-bit copy is saved for backward
        assert est.weight_copies == _linear_weights(model, 2) > 0


@pytest.fixture(scope="module")
def dp_reports():
    return check_all(run_workers(data_parallel_bf16, 2, deadline=150.0))


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("target", ["ddp", "fsdp"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_data_parallel_bf16_within_10_percent(dp_reports, family, target):
    for report in dp_reports:
        case = report[f"{family}/{target}"]
        est, real = case["est"], case["real"]
        for part in ("params", "grads", "optimizer_state", "activations", "engine", "peak"):
            assert _within(est[part], real[part]), (part, case)
        assert real["grad_dtype"] == "torch.float32"  # DDP's own; FSDP2 reduces in fp32
        assert real["activations"] < 0.8 * case["fp32_activations"], case


# ----- analytic: the parts of each target in bf16 -------------------------------------------------
def _shard(p: torch.Tensor, dp: int, size: int) -> int:
    rows = -(-p.shape[0] // dp)
    return rows * (p.numel() // p.shape[0]) * size


def test_bf16_parts_of_every_target_are_analytic():
    model, data = make_llama(), make_batch()
    sch = slapo.create_schedule(model)
    params = list(model.parameters())
    numel = sum(_numel(params))
    blocks = [sum(_numel(layer.parameters())) for layer in model.model.layers]
    root = numel - sum(blocks)

    fsdp = estimate_layout(sch, data, target="fsdp", dp=4, precision="bf16")
    shards = sum(_shard(p, 4, 4) for p in params)  # float32 shards, padded rows
    assert fsdp.params == fsdp.grads == shards
    assert 2 * shards <= fsdp.optimizer_state <= 2 * shards + 4 * len(params)  # + step counts
    # gathered in bf16: the root's and two blocks'
    assert fsdp.engine_parts == {"fsdp gathered parameters": 2 * (root + 2 * max(blocks))}
    fp32 = estimate_layout(sch, data, target="fsdp", dp=4)
    assert 2 * fsdp.engine == fp32.engine and fsdp.params == fp32.params
    assert fsdp.activations < 0.75 * fp32.activations and fsdp.weight_copies == 0

    zero = estimate_layout(sch, data, target="deepspeed", dp=4, zero_stage=2, precision="bf16")
    partition = -(-4 * numel // 4)
    assert (zero.params, zero.grads) == (2 * numel, -(-2 * numel // 4))  # bf16 module, grads 1/4
    assert zero.engine_parts == {"deepspeed fp32 partition": partition}
    assert 2 * partition <= zero.optimizer_state <= 2 * partition + 4 * len(params)

    rp = estimate_layout(sch, data, target="roundpipe", precision="bf16")
    assert (rp.params, rp.grads) == (2 * numel, 2 * numel)  # the host's bf16 model
    assert rp.engine_parts == {"roundpipe fp32 optimizer copies": 4 * numel}
    assert rp.device_resident == 4 * numel + rp.buffers  # one stage: bf16 params and grads

    eager = estimate_layout(sch, data, precision="bf16")  # autocast: float32 everything held
    assert (eager.params, eager.grads, eager.engine) == (4 * numel, 4 * numel, 0)
    assert eager.weight_copies == _linear_weights(model, 2)
    for est in (fsdp, zero, rp, eager):
        assert est.precision == "bf16" and est.peak == est.params + est.buffers + est.grads + (
            est.optimizer_state + est.activations + est.engine
        )  # fmt: skip


def test_fsdp_pipeline_stages_autocast():
    """``pp`` > 1: the stages autocast and their FSDP2 units have no policy: float32 gathered."""
    spec = LayoutSpec("fsdp", dp=2, pp=2, precision="bf16")
    assert not spec.casts_module and spec.describe().endswith("bf16")
    assert LayoutSpec("fsdp", dp=2, precision="bf16").casts_module


# ----- from a config: a directory of config.json only; CUDA's reserved bytes ---------------------
def _config_dir(path, **sizes):
    sizes = {"vocab_size": 300, "max_position_embeddings": 64, **sizes}
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, **sizes,
    )  # fmt: skip
    cfg.save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def test_estimate_a_config_only_directory(tmp_path, capsys):
    model_dir = _config_dir(tmp_path / "llama-config")
    args = ["estimate", "--model", str(model_dir), "--batch-size", "2", "--seq-len", "32"]
    args += ["--target", "fsdp", "--dp", "2"]
    assert main([*args, "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16 on cpu" in out and "fsdp gathered parameters" in out
    assert main([*args, "--precision", "bf16", "--device", "cuda", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    assert (doc["precision"], doc["device"], doc["target"]) == ("bf16", "cuda", "fsdp")
    assert doc["reserved"] >= doc["required"]
    assert main([*args, "--json"]) == 0  # on this machine's device: its default precision
    fp32 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    assert fp32["params"] == doc["params"] and fp32["engine"] == 2 * doc["engine"]

    from slapo.train import TrainConfig
    from slapo.train.run_memory import estimate_config

    cfg = TrainConfig(model=str(model_dir), batch_size=2, seq_len=32, device="cuda")
    est = estimate_config(cfg)  # the Python API; cuda: bf16 unless --precision says otherwise
    assert (est.device, est.precision) == ("cuda", "bf16")
    assert est.stand_in == (None if torch.cuda.is_available() else "cpu")
    assert "reserved (CUDA allocator)" in str(est)
    # training needs the weights: the directory is refused when they are loaded
    from slapo.train.presets import build_model

    with pytest.raises(slapo.SlapoError, match="holds no model.safetensors"):
        build_model(cfg)


def test_a_large_vocabulary_and_long_sequence_estimate(tmp_path):
    """Llama 3's vocabulary and 8192 tokens, on a narrow model: the batch's token ids lie within
    the vocabulary, the logits are counted (fake: nothing is allocated)."""
    from slapo.train import TrainConfig
    from slapo.train.run_memory import estimate_config

    model_dir = _config_dir(
        tmp_path / "wide-vocab", vocab_size=128256, max_position_embeddings=8192
    )
    cfg = TrainConfig(
        model=str(model_dir), batch_size=1, seq_len=8192, precision="bf16", ckpt_ratio=1.0,
        ckpt_policy="full", target="fsdp",
    )  # fmt: skip
    est = estimate_config(cfg, dp=8)
    logits = 8192 * 128256
    # the loss's float32 log-softmax of the logits is saved for its backward
    assert est.by_block()["(root)"] >= 4 * logits
    small = _config_dir(tmp_path / "small-vocab", vocab_size=100)  # below the bytes' 256
    assert estimate_config(TrainConfig(model=str(small), batch_size=2, seq_len=32)).peak > 0


def test_reserved_rounds_to_the_allocator_blocks():
    assert allocator_rounding([100, 512, 2**20 + 1]) == 412 + 2**20 - 1
    assert reserved_bytes(100 * 2**20) == 106 * 2**20  # +5%, whole 2 MiB segments
    est = slapo.estimate_memory(H.make("gpt2"), batch(H.VOCAB), precision="bf16", device="cuda")
    assert est.device == "cuda" and est.rounding["params"] > 0
    assert est.reserved == reserved_bytes(est.required, sum(est.rounding.values()))
    assert est.reserved > est.required and "reserved (CUDA allocator)" in est.table()


def test_bad_precisions_name_the_argument():
    with pytest.raises(EstimateError, match="precision='int8'"):
        slapo.estimate_memory(H.make("gpt2"), batch(H.VOCAB), precision="int8")
    with pytest.raises(EstimateError, match="precision='fp8'"):
        LayoutSpec("fsdp", dp=2, precision="fp8")
    base = slapo.estimate_memory(H.make("gpt2"), batch(H.VOCAB))
    with pytest.raises(EstimateError, match="estimate the step with precision='bf16'"):
        apply_layout(base, H.make("gpt2"), LayoutSpec("fsdp", dp=2, precision="bf16"))


# ----- on a GPU (skipped without one): the allocator's own figures -------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_live_peak_and_reserved_on_cuda():
    """An eager bf16 step (autocast on CUDA, whose op lists the fake step then uses): the live
    peak within 10% of ``max_memory_allocated``; ``reserved`` printed beside the allocator's."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).cuda().train()
    sch = apply_schedule(model, attn_op="sdpa")
    ids = torch.randint(0, 1024, (8, 512), device="cuda")
    data = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = slapo.estimate_memory(sch, data, optimizer=opt, precision="bf16")
    assert (est.device, est.stand_in, est.precision) == ("cuda", None, "bf16")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state and the cuBLAS workspace exist from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = est.live_peak - est.params - est.buffers - est.optimizer_state
    reserved = torch.cuda.max_memory_reserved()
    print(f"bf16 CUDA step: allocated {measured:,} B (estimate {predicted:,} B); reserved "
          f"{reserved:,} B (estimate {est.reserved:,} B)")  # fmt: skip
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
    assert est.reserved >= torch.cuda.max_memory_allocated()
