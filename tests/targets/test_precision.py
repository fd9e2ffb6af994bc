"""Mixed precision on one process: ``slapo.build(..., precision=)`` on eager and roundpipe, the
loss scaler of fp16, the precision and device of ``slapo train``.

bf16 comparisons use ``jobs_precision.BF16_REL`` (a relative error of 2% of each gradient's norm:
bf16 rounds each value by up to 2**-8, and a reordered sum lands a few roundings apart); the
2-rank targets (ddp, fsdp, pipeline) run in ``test_dp.py``'s shared job, DeepSpeed's in
``test_deepspeed.py``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from jobs_precision import BF16_REL, assert_close_rel, reference_step

import hf_models
import slapo
from slapo.model_schedule import apply_schedule
from slapo.precision import DeviceError, Precision, PrecisionError, resolve_device
from slapo.targets.mixed_precision import LossScaledOptimizer, grad_scaler_of
from slapo.train import TrainConfig
from slapo.train.loop import train


def _batch() -> dict[str, torch.Tensor]:
    return hf_models.batch(seed=3)


def test_precision_names_and_errors():
    assert Precision.of("bfloat16") == Precision.of(torch.bfloat16) == Precision("bf16")
    assert Precision.of(None).name == "fp32" and not Precision.of(None).mixed
    with pytest.raises(PrecisionError, match="fp32"):
        Precision.of("fp8")
    with pytest.raises(PrecisionError, match="float32, bfloat16 or float16"):
        Precision.of(torch.int8)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="device must be one of"):
        resolve_device("tpu")


def test_eager_bf16_schedule_equals_unscheduled_bf16():
    """The ready llama schedule (checkpointed blocks, SDPA) built in bf16: the loss and every
    gradient equal the unscheduled model's under autocast; weights and gradients stay fp32."""
    model = hf_models.make("llama", dropout=0.0)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), _batch(), autocast=True)
    sch = apply_schedule(model, ckpt_ratio=1.0, attn_op="sdpa")
    built, opt = slapo.build(sch, precision="bf16", optimizer=torch.optim.AdamW)
    loss = slapo.train_step(built, _batch())
    assert_close_rel(loss, ref_loss, "loss")
    for name, p in built.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert_close_rel(p.grad, ref_grads[name], f"gradient of {name}")
    with torch.no_grad():
        assert built(**_batch()).logits.dtype == torch.bfloat16
    opt.step()


def test_eager_fp16_overflow_skips_the_step_and_halves_the_scale():
    built, opt = slapo.build(
        slapo.create_schedule(hf_models.make("llama", dropout=0.0)), precision="fp16",
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip
    assert isinstance(opt, LossScaledOptimizer)
    scaler = grad_scaler_of(built)
    scale = scaler.get_scale()
    before = {n: p.detach().clone() for n, p in built.named_parameters()}
    loss = slapo.train_step(built, _batch())
    assert loss < 100  # the loss returned is unscaled
    next(built.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(p, before[n]) for n, p in built.named_parameters())
    slapo.train_step(built, _batch())
    opt.step()
    assert any(not torch.equal(p, before[n]) for n, p in built.named_parameters())
    state = opt.state_dict()  # the scaler's state goes with the optimizer's (checkpoints)
    assert state["grad_scaler"]["scale"] == scale / 2


def test_roundpipe_bf16_equals_the_bf16_model_with_float32_master_copies():
    """RoundPipe's mixed precision: the model computes in bf16 (as the whole model cast to bf16
    does on one device) and the optimizer steps float32 copies."""
    model = hf_models.make("llama", dropout=0.0)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), _batch(), autocast=False)
    built, opt = slapo.build(
        slapo.create_schedule(model), target="roundpipe", precision="bf16",
        optimizer=torch.optim.AdamW, pin_model="off",
    )  # fmt: skip
    loss = slapo.train_step(built, _batch())
    assert_close_rel(loss, ref_loss, "roundpipe loss")
    assert {p.dtype for p in built.optim_parameters()} == {torch.float32}
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert_close_rel(p.grad, ref_grads[name], f"roundpipe gradient of {name}")
    opt.step()
    opt.zero_grad()


def test_main_job_bf16_follows_the_fp32_curve():
    """40 bf16 steps of the main job (the ready schedule, autocast) stay within 0.05 of the
    fp32 loss at every step (measured: 0.003); and the run says what it ran in."""
    common = dict(steps=40, baseline_steps=0, progress=False, sample=False, compile_model=False)
    fp32 = train(TrainConfig(precision="fp32", **common))
    bf16 = train(TrainConfig(precision="bf16", **common))
    gaps = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    assert len(gaps) == 40 and max(gaps) < 0.05, max(gaps)
    assert bf16["losses"][-1] < bf16["losses"][0] - 1.0  # it trains
    assert (bf16["precision"], bf16["device"], fp32["precision"]) == ("bf16", "cpu", "fp32")
    assert BF16_REL < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line_naming_the_flag():
    done = subprocess.run(
        [sys.executable, "-m", "slapo", "train", "--device", "cuda", "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slapo train: --device cuda: no CUDA GPU")


@pytest.mark.parametrize("target", ["eager", "roundpipe"])
def test_bf16_checkpoints_keep_float32_master_weights_and_resume_exactly(tmp_path, target):
    """``--save`` in bf16 writes the float32 master weights (RoundPipe's optimizer copies, not
    its bf16 model); a run resumed from step 3 continues the uninterrupted one bit for bit."""
    from safetensors.torch import load_file

    common = dict(target=target, precision="bf16", baseline_steps=0, progress=False,
                  sample=False, compile_model=False, seq_len=32, batch_size=4)  # fmt: skip
    save = tmp_path / "run"
    whole = train(TrainConfig(steps=6, save=str(save), save_every=3, **common))["losses"]
    again = train(TrainConfig(steps=6, resume=str(save / "step-000003"), **common))
    assert again["resumed_at"] == 3 and again["losses"] == whole
    weights = load_file(save / "model.safetensors")
    assert weights and {t.dtype for t in weights.values()} == {torch.float32}


@pytest.mark.parametrize("module", ["slapo.precision", "slapo.targets.mixed_precision"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    from torch import nn

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, extraglobs={"torch": torch, "nn": nn}, verbose=False)
    assert result.attempted > 0 and result.failed == 0, result
