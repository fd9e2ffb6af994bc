"""`slapo train --model`: a local model directory, or a transformers model type with no ready
schedule (the generic plan), each trained on data of the user's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from your_inputs import LLAMA_POSITIONS, documents, write_jsonl

from slapo.cli import main
from slapo.train import TrainConfig, build_model, train

# Seconds, not minutes: a short run, no baseline, nothing compiled.
QUICK = ["--steps", "30", "--seq-len", "32", "--batch-size", "4", "--baseline-steps", "0",
         "--no-progress", "--compile-model", "false"]  # fmt: skip


def _falls(losses: list[float]) -> bool:
    """The mean of the last five losses well under that of the first five."""
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return last < 0.8 * first


@pytest.mark.slow
def test_a_local_llama_directory_trains_on_jsonl_with_its_own_tokenizer(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "train.jsonl", documents())
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "slapo", "train", "--model", str(llama_dir),
           "--data", str(data), "--output-dir", str(out), *QUICK]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["losses"]) == 30 and _falls(metrics["losses"]), metrics["losses"]
    # the directory's own tokenizer (300 tokens, beyond bytes), its family's ready schedule
    assert metrics["tokenizer"] == str(llama_dir) and metrics["plan"] == "ready schedule of llama"
    assert metrics["checkpointed_layers"] == 2 and metrics["from_cache"] is False
    cache = Path(metrics["token_cache"])
    assert (
        cache.parent == tmp_path / ".slapo-cache" and cache.stat().st_size == 2 * metrics["tokens"]
    )
    assert "plan: ready schedule of llama" in done.stdout and "data: " in done.stdout
    assert metrics["sample"]  # text decoded with the directory's tokenizer


def test_a_model_type_without_a_ready_schedule_trains_on_txt_with_the_generic_plan(
    tmp_path, capsys
):
    data = tmp_path / "notes.txt"
    data.write_text("\n".join(documents()))
    out = tmp_path / "run"
    argv = ["train", "--model", "phi3", "--data", str(data), "--output-dir", str(out), *QUICK]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert _falls(metrics["losses"]), metrics["losses"]
    plan = "generic plan: 2 of 4 blocks (Phi3DecoderLayer, from _no_split_modules) checkpointed"
    assert metrics["plan"] == plan and metrics["checkpointed_layers"] == 2
    assert metrics["tokenizer"] == "bytes" and metrics["tokens"] == len(data.read_bytes()) + 1
    assert f"plan: {plan}" in capsys.readouterr().out


def test_the_generic_plan_gives_the_unscheduled_loss_curve(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("\n".join(documents()))
    small = {"steps": 3, "batch_size": 2, "seq_len": 16, "progress": False, "sample": False,
             "baseline_steps": 0, "model": "phi3", "data": str(data)}  # fmt: skip
    scheduled = train(TrainConfig(ckpt_ratio=1.0, **small))
    plain = train(TrainConfig(unscheduled=True, **small))
    assert scheduled["checkpointed_layers"] == 4 and plain["checkpointed_layers"] == 0
    assert scheduled["plan"].startswith("generic plan: 4 of 4 blocks")
    torch.testing.assert_close(scheduled["losses"], plain["losses"])


def test_directory_weights_load_onto_the_meta_model_in_float32(tmp_path):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=LLAMA_POSITIONS,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    saved = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "bf16")
    model = build_model(TrainConfig(model=str(tmp_path / "bf16")))
    assert type(model) is tf.LlamaForCausalLM and not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # re-tied, not copied
    for name, value in saved.state_dict().items():
        assert model.state_dict()[name].dtype == torch.float32
        assert model.state_dict()[name].equal(value.float()), name
    meta = build_model(TrainConfig(model=str(tmp_path / "bf16")), weights=False)
    assert all(p.is_meta for p in meta.parameters())  # what a memory estimate builds
