"""The main job (`slapo train`), the CLI and the embedded corpus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slapo.data import ByteBatches, default_corpus
from slapo.train import TrainConfig, default_schedule, train

SMALL = {"steps": 3, "batch_size": 2, "seq_len": 16, "progress": False}


def test_corpus_is_real_text_and_batches_reproduce():
    corpus = default_corpus(50_000)
    assert len(corpus) == 50_000 and b"def " in corpus
    a = ByteBatches(corpus, 2, 8, seed=3)
    b = ByteBatches(corpus, 2, 8, seed=3)
    first = a.next()["input_ids"]
    assert first.equal(b.next()["input_ids"]) and first.max() < 256
    state = a.state_dict()
    nxt = a.next()["input_ids"]
    a.load_state_dict(state)
    assert a.next()["input_ids"].equal(nxt)


def test_scheduled_training_gives_the_unscheduled_loss_curve():
    scheduled = train(TrainConfig(ckpt_ratio=1.0, **SMALL))
    plain = train(TrainConfig(ckpt_ratio=0.0, **SMALL))
    assert scheduled["checkpointed_layers"] == 4 and plain["checkpointed_layers"] == 0
    assert scheduled["losses"] == plain["losses"]
    assert all(x > 0 for x in scheduled["step_tokens_per_s"])


def test_default_schedule_checkpoints_a_fraction_of_layers():
    from slapo.train import build_model

    sch = default_schedule(build_model(TrainConfig()), 0.5)
    assert [r.path for r in sch.metadata.primitives] == ["model.layers.0", "model.layers.1"]
    with pytest.raises(ValueError, match="ckpt_ratio"):
        default_schedule(build_model(TrainConfig()), 1.5)


@pytest.mark.slow
def test_cli_train_writes_metrics_and_prints_a_summary(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "slapo",
        "train",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--no-progress",
        "--output-dir",
        str(tmp_path),
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout and "peak memory" in out.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    last = json.loads(out.stdout.strip().splitlines()[-1])  # the line `slapo tune` reads
    assert last["throughput"] == metrics["tokens_per_s"] > 0
    assert len(metrics["losses"]) == 2 and metrics["config"]["seq_len"] == 16
    bad = subprocess.run([*cmd[:4], "--steps", "0"], capture_output=True, text=True, timeout=240)
    assert bad.returncode != 0 and "--steps must be positive" in bad.stderr


def test_cli_lists_primitives(capsys):
    from slapo.cli import main

    assert main(["primitives"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line}
    assert {"replace", "checkpoint", "fork_rng", "annotate", "sync", "hook"} <= listed
