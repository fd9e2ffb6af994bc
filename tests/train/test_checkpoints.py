"""`slapo train --save/--save-every/--resume`, `--lr-schedule`, `--eval-*` and TensorBoard: a
run users can leave alone and pick up again exactly."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types

import pytest
from your_inputs import documents, write_jsonl

from shared_launches import plan_run
from slapo.train import TrainConfig, train
from slapo.train import loop as loop_module
from slapo.train.lr_schedule import LRFactor
from slapo.train.state import STATE_FILE, find_checkpoint

# gpt2 has dropout: the RNG streams must be restored for a resumed curve to match
RUN = {"model": "gpt2", "batch_size": 2, "seq_len": 32, "progress": False, "sample": False,
       "baseline_steps": 0, "compile_model": False, "tensorboard": False}  # fmt: skip


def test_lr_factor_at_steps():
    assert [LRFactor("constant", 3, 10)(s) for s in (0, 1, 2, 3, 9)] == [1 / 3, 2 / 3, 1, 1, 1]
    linear = LRFactor("linear", 2, 6)
    assert [linear(s) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cosine = LRFactor("cosine", 0, 4)
    assert [cosine(s) for s in range(4)] == pytest.approx(
        [1.0, 0.5 + 0.5 * 2**-0.5, 0.5, 0.5 - 0.5 * 2**-0.5]
    )


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A 6-step cosine run that saves every 2 steps (keeping 2) and evaluates every 3."""
    root = tmp_path_factory.mktemp("interrupted")
    cfg = {**RUN, "steps": 6, "lr_schedule": "cosine", "warmup_steps": 2, "lr": 1e-2,
           "eval_fraction": 0.1, "eval_every": 3}  # fmt: skip
    full = train(TrainConfig(**cfg, save=str(root / "out"), save_every=2, keep=2,
                             output_dir=str(root / "run")))  # fmt: skip
    return root, cfg, full


def test_save_every_keeps_the_last_k_and_the_final_save(interrupted):
    root, _, full = interrupted
    out = root / "out"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in root.iterdir()) == ["out", "run"]  # no temp directory left
    files = {p.name for p in out.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", STATE_FILE} <= files
    assert {p.suffix for p in out.rglob("*") if p.is_file()} == {".json", ".safetensors"}
    state = json.loads((out / "step-000004" / STATE_FILE).read_text())
    assert state["step"] == 4 and state["record"]["losses"] == full["losses"][:4]


def test_lr_schedule_values_are_recorded(interrupted):
    _, cfg, full = interrupted
    factor = LRFactor("cosine", 2, 6)
    assert full["lrs"] == pytest.approx([cfg["lr"] * factor(s) for s in range(6)], rel=1e-12)


def test_eval_loss_and_perplexity_in_metrics(interrupted):
    root, _, full = interrupted
    metrics = json.loads((root / "run" / "metrics.json").read_text())
    assert [e["step"] for e in metrics["eval"]] == [3, 6]
    for e in metrics["eval"]:
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]))
    assert metrics["eval_loss"] == metrics["eval"][-1]["loss"] and metrics["eval_perplexity"] > 1
    assert metrics["eval_data"] == "the last 0.1 of embedded corpus"


def test_resume_from_a_step_equals_the_uninterrupted_run(interrupted):
    root, cfg, full = interrupted
    rest = train(TrainConfig(**cfg, resume=str(root / "out" / "step-000004")))
    # Exact: weights, Adam state, LR schedule, data position and RNG restored bit for bit
    assert rest["losses"] == full["losses"] and rest["lrs"] == full["lrs"]
    assert rest["eval"] == full["eval"] and rest["resumed_at"] == 4


def test_resume_of_a_directory_without_a_final_save_takes_its_latest_step(interrupted, tmp_path):
    root, _, _ = interrupted
    for step in ("step-000002", "step-000004"):
        shutil.copytree(root / "out" / step, tmp_path / "killed" / step)
    assert find_checkpoint(str(tmp_path / "killed")) == (
        tmp_path / "killed" / "step-000004",
        "full",
    )


def test_n_steps_and_resume_for_n_more_equals_2n_steps(tmp_path):
    full = train(TrainConfig(**RUN, steps=4))
    train(TrainConfig(**RUN, steps=2, save=str(tmp_path / "half")))
    rest = train(TrainConfig(**RUN, steps=4, resume=str(tmp_path / "half")))
    assert rest["losses"] == full["losses"]


def test_save_is_a_hugging_face_directory_with_the_tokenizer(tmp_path, llama_dir, monkeypatch):
    import transformers as tf

    trained = {}
    real_save = loop_module.save_run
    monkeypatch.setattr(
        loop_module,
        "save_run",
        lambda p, s, **k: trained.update(s.module.state_dict()) or real_save(p, s, **k),
    )
    scalars = []

    class Writer:  # stands in for tensorboard's SummaryWriter (an optional package)
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def close(self):
            pass

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer)
    )
    data = write_jsonl(tmp_path / "train.jsonl", documents())
    held_out = write_jsonl(tmp_path / "eval.jsonl", documents(40, seed=3))
    out = tmp_path / "out"
    cfg = {**RUN, "model": str(llama_dir), "tensorboard": True}
    summary = train(TrainConfig(**cfg, steps=3, data=str(data), eval_data=str(held_out),
                                save=str(out), output_dir=str(tmp_path / "run")))  # fmt: skip
    loaded = tf.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is tf.LlamaForCausalLM
    for name, value in loaded.state_dict().items():
        assert value.equal(trained[name]), name
    before = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert not before.model.layers[0].mlp.up_proj.weight.equal(
        loaded.model.layers[0].mlp.up_proj.weight
    )
    tokenizer = tf.AutoTokenizer.from_pretrained(out)
    assert (
        tokenizer("the quick fox")["input_ids"]
        == tf.AutoTokenizer.from_pretrained(llama_dir)("the quick fox")["input_ids"]
    )
    assert summary["eval_data"] == str(held_out) and [e["step"] for e in summary["eval"]] == [3]
    tags = {tag for tag, _ in scalars}
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss", "eval/perplexity"} == tags
    assert [s for tag, s in scalars if tag == "train/loss"] == [1, 2, 3]


def test_without_tensorboard_a_run_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    train(TrainConfig(**{**RUN, "tensorboard": True}, steps=1, output_dir=str(tmp_path / "run")))
    notes = [line for line in capsys.readouterr().err.splitlines() if "TensorBoard" in line]
    assert len(notes) == 1 and "pip install tensorboard" in notes[0]
    assert (tmp_path / "run" / "metrics.json").is_file()


# The two torchrun runs of the test below, planned into the session's 2-process launch (the
# ``launches`` fixture, tests/conftest.py): the save, then the resume from it.
TP2 = ["--tp", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
       "--baseline-steps", "0", "--compile-model", "false", "--no-progress", "--no-sample",
       "--lr-schedule", "linear", "--warmup-steps", "1", "--no-tensorboard"]  # fmt: skip
plan_run(2, "tp2-save", lambda root: [*TP2, "--save", str(root / "tp2-ckpt"), "--save-every", "2"])
plan_run(2, "tp2-resume", lambda root: [*TP2, "--resume", str(root / "tp2-ckpt/step-000002")])


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_save_is_whole_and_resumes_exactly(launches):
    """Under torchrun --tp 2 the saved weights are gathered whole (from_pretrained loads them)
    and a resume from a --save-every step continues the curve exactly."""
    import transformers as tf

    full, _ = launches.result(2, "tp2-save")
    rest, _ = launches.result(2, "tp2-resume")
    assert rest == full
    loaded = tf.AutoModelForCausalLM.from_pretrained(launches.dir(2) / "tp2-ckpt")
    assert loaded.model.layers[0].mlp.down_proj.weight.shape == (128, 352)  # not a half


def test_tensorboard_event_files_hold_the_loss_curve(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    summary = train(TrainConfig(**{**RUN, "tensorboard": True}, steps=3, output_dir=str(run)))
    events = EventAccumulator(str(run))
    events.Reload()
    losses = [event.value for event in events.Scalars("train/loss")]
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3]
    assert losses == pytest.approx(summary["losses"], rel=1e-6)
