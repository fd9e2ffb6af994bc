"""The main job (`slapo train`), the CLI and the embedded corpus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dist_utils import free_port
from shared_launches import plan_run
from slapo.data import ByteBatches, default_corpus
from slapo.train import TrainConfig, default_schedule, train

# No baseline, no text, no compilation: the tests below compare loss curves exactly.
SMALL = {
    "steps": 3, "batch_size": 2, "seq_len": 16, "progress": False,
    "baseline_steps": 0, "sample": False, "compile_model": False,
}  # fmt: skip


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
    # Exact on any CPU: a non-reentrant checkpoint keeps the autograd graph and reruns the same
    # kernels on the same operands (RNG restored), and both runs train without the KV cache.
    assert scheduled["losses"] == plain["losses"]
    assert all(x > 0 for x in scheduled["step_tokens_per_s"])


@pytest.mark.slow
def test_the_default_run_shows_the_schedule_beside_a_short_eager_baseline(tmp_path):
    from slapo.model_schedule import recommended_knobs
    from slapo.train import format_summary

    cfg = {"steps": 4, "batch_size": 2, "seq_len": 16, "progress": False}
    out = train(TrainConfig(baseline_steps=2, output_dir=str(tmp_path), **cfg))
    knobs = recommended_knobs("llama")
    assert {k: out["knobs"][k] for k in knobs} == knobs and out["knobs"]["compile_model"]
    base = out["baseline"]
    assert base["label"] == "unscheduled" and len(base["losses"]) == 2 and len(out["losses"]) == 4
    # the same weights and batches: the compiled, checkpointed model starts on eager's loss
    # (float32 tolerance: inductor orders the reductions of the norms and softmax its own way)
    assert abs(base["losses"][0] - out["losses"][0]) < 1e-4
    assert abs(base["losses"][1] - out["losses"][1]) < 1e-3
    assert out["activation_mb"] < 0.7 * base["activation_mb"]  # selective checkpointing
    assert base["estimated_peak_mb"] == pytest.approx(base["peak_memory_mb"], rel=0.1)
    assert out["estimated_peak_mb"] == pytest.approx(out["peak_memory_mb"], rel=0.1)
    assert out["sample"] and out["sample"][0].startswith("def ")
    assert (tmp_path / "loss.png").exists()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["baseline"]["losses"] == base["losses"] and metrics["sample"] == out["sample"]
    text = format_summary(out)
    assert "unscheduled (2 steps)" in text and "x peak memory" in text
    assert "text from the trained model:" in text and "compile_model=True" in text


def test_text_from_every_family():
    from slapo.train import build_model
    from slapo.train.sample import sample_text

    for family in ("llama", "gpt2", "opt"):
        lines = sample_text(build_model(TrainConfig(model=family)), family, new_tokens=12)
        text = "\n".join(lines)  # the prompt and up to 12 bytes (fewer after an end-of-text)
        assert text.startswith("def ") and 4 < len(text) <= 16
    masked, filled = sample_text(build_model(TrainConfig(model="bert")), "bert")
    assert masked.startswith("masked:  ") and "_" in masked and filled.startswith("filled:  ")
    assert len(masked) == len(filled)
    original, copy = sample_text(build_model(TrainConfig(model="t5")), "t5", new_tokens=16)
    assert original.startswith("input:   ") and copy.startswith("output:  ")


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
        "--baseline-steps",
        "0",  # the baseline beside the run: the test above
        "--output-dir",
        str(tmp_path),
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout and "peak memory" in out.stdout
    assert f"metrics.json and loss.png: {tmp_path}" in out.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    last = json.loads(out.stdout.strip().splitlines()[-1])  # the line `slapo tune` reads
    assert last["throughput"] == metrics["tokens_per_s"] > 0
    assert len(metrics["losses"]) == 2 and metrics["config"]["seq_len"] == 16
    bad = subprocess.run([*cmd[:4], "--steps", "0"], capture_output=True, text=True, timeout=240)
    assert bad.returncode != 0 and "--steps must be positive" in bad.stderr
    # without --output-dir: a run directory of its own under ./runs, printed
    default = [*cmd[:-3], "--baseline-steps", "0", "--no-sample", "--compile-model", "false"]
    out = subprocess.run(default, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("llama-") and (run_dir / "metrics.json").exists()
    assert f"metrics.json and loss.png: runs/{run_dir.name}" in out.stdout


@pytest.mark.parametrize("model", ["gpt2", "bert", "opt", "t5"])
def test_every_model_family_trains_with_its_schedule(model):
    out = train(TrainConfig(model=model, ckpt_ratio=1.0, **SMALL))
    plain = train(TrainConfig(model=model, ckpt_ratio=0.0, **SMALL))
    assert out["checkpointed_layers"] > 0 and plain["checkpointed_layers"] == 0
    # float32 tolerance: the families' schedules may fuse or swap kernels (not only checkpoint)
    torch.testing.assert_close(out["losses"], plain["losses"])


def test_compare_runs_baseline_and_schedule_side_by_side(tmp_path):
    from slapo.train import format_summary

    out = train(TrainConfig(compare=True, ckpt_ratio=1.0, output_dir=str(tmp_path), **SMALL))
    base = out["baseline"]
    assert base["checkpointed_layers"] == 0 and out["checkpointed_layers"] == 4
    assert base["losses"] == out["losses"]  # checkpointing changes no numerics
    assert out["activation_mb"] < base["activation_mb"]
    table = format_summary(out)
    assert "unscheduled" in table and "scheduled / unscheduled" in table and "x tokens/s" in table
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["baseline"]["losses"] == metrics["losses"] and len(metrics["losses"]) == 3
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_continues_the_uninterrupted_loss_curve(tmp_path):
    cfg = {**SMALL, "model": "gpt2", "fused_loss": True}  # gpt2 has dropout: RNG state matters
    full = train(TrainConfig(**{**cfg, "steps": 5}))
    train(TrainConfig(**{**cfg, "steps": 2}, save=str(tmp_path / "ckpt.pt")))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # atomic: no .tmp-slapo left
    # no pickle: safetensors and JSON only
    assert {p.suffix for p in (tmp_path / "ckpt.pt").iterdir()} == {".json", ".safetensors"}
    rest = train(TrainConfig(**{**cfg, "steps": 5}, resume=str(tmp_path / "ckpt.pt")))
    # Exact: resuming restores the bits of weights, optimizer state, RNG and data position
    assert rest["losses"] == full["losses"]


# The torchrun runs of the two 2-process tests below that read metrics.json, planned into the
# session's 2-process launch (the ``launches`` fixture, tests/conftest.py), in this order.
# eager: 3 runs x 2 ranks
FSDP = ["--target", "fsdp", "--model", "gpt2", "--batch-size", "2", "--seq-len", "16",
        "--no-progress", "--compile-model", "false"]  # fmt: skip
plan_run(2, "fsdp-full", lambda root: [*FSDP, "--steps", "4"])
plan_run(2, "fsdp-first", lambda root: [*FSDP, "--steps", "2", "--save", str(root / "fsdp-ckpt")])
plan_run(2, "fsdp-rest", lambda root: [*FSDP, "--steps", "4", "--resume", str(root / "fsdp-ckpt")])
DDP_PP = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--no-progress"]
DDP_PP_TAIL = ["--baseline-steps", "0", "--no-sample"]
plan_run(2, "ddp", lambda root: ["--target", "ddp", *DDP_PP, *DDP_PP_TAIL])
plan_run(2, "pipeline", lambda root: ["--target", "pipeline", *DDP_PP, "--num-stages", "2",
                                      *DDP_PP_TAIL])  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_fsdp_resume_continues_the_loss_curve(launches):
    """FSDP2 parameters and Adam state are DTensors: gathered whole into one Hugging Face
    directory; resume re-shards them."""
    losses = {name: launches.result(2, f"fsdp-{name}")[0] for name in ("full", "first", "rest")}
    root = launches.dir(2)
    assert [p.name for p in root.glob("fsdp-ckpt*")] == ["fsdp-ckpt"]  # no fsdp-ckpt.rank<r>
    assert (root / "fsdp-ckpt" / "config.json").is_file()
    # Exact: both runs launch the same way and resuming restores every bit of the state
    assert losses["rest"] == losses["full"]


def test_bad_options_are_clear_errors(tmp_path):
    from slapo.exceptions import SlapoError

    with pytest.raises(SlapoError, match="--tp 2 needs a multiple of 2 processes, not 1"):
        train(TrainConfig(tp=2, **SMALL))
    (tmp_path / "old.pt").write_bytes(b"a torch.save pickle")
    with pytest.raises(SlapoError, match="--resume .*old.pt is a file"):
        train(TrainConfig(resume=str(tmp_path / "old.pt"), **SMALL))
    with pytest.raises(SlapoError, match="--model must be one of"):
        train(TrainConfig(model="no-such-model", **SMALL))


def test_roundpipe_target_trains(monkeypatch):
    """`slapo train --target roundpipe` runs the ordinary loop (backward, optimizer.step,
    zero_grad) on the RoundPipe model: it must give eager's loss curve."""
    import torch

    import roundpipe

    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    roundpipe.init_devices(num_virtual=2)  # 2 CPU virtual devices -> 3 microbatches of 2, 1, 1
    cfg = {**SMALL, "steps": 5, "batch_size": 4}
    out = train(TrainConfig(target="roundpipe", **cfg))
    eager = train(TrainConfig(**cfg))
    # RoundPipe runs the batch as microbatches and merges their losses: float32 sums are
    # ordered differently than in eager's one pass, hence assert_close and not equality
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(eager["losses"]))
    assert out["losses"][-1] < out["losses"][0]
    roundpipe.device.wait_devices_idle(timeout=30)


@pytest.mark.slow
def test_torchrun_tensor_parallel_matches_one_process(tmp_path):
    # eager (compiled blocks under tensor parallelism: tests/model_schedule/test_selective_compile)
    args = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress", "--json",
            "--compile-model", "false"]  # fmt: skip
    one = subprocess.run(
        [sys.executable, "-m", "slapo", "train", *args], capture_output=True, text=True, timeout=240
    )
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "slapo", "train", "--tp", "2", *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    loss_one = json.loads(one.stdout.strip().splitlines()[-1])["final_loss"]
    loss_two = json.loads(two.stdout.strip().splitlines()[-1])["final_loss"]
    assert abs(loss_one - loss_two) < 1e-4, (loss_one, loss_two)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_data_and_pipeline_parallel_follow_the_one_process_loss(launches):
    """Two processes: ddp is 2 replicas on slices of a global batch of 2 x 4 (one process's batch
    of 8); the pipeline is 2 stages of one replica (one process's batch of 4). fsdp: the resume
    test below and tests/train/test_gathered_checkpoints.py."""
    one = {b: train(TrainConfig(**{**SMALL, "steps": 2, "batch_size": b}))["losses"]
           for b in (4, 8)}  # fmt: skip
    for target, batch in (("ddp", 8), ("pipeline", 4)):
        losses, _ = launches.result(2, target)
        torch.testing.assert_close(losses, one[batch], rtol=0, atol=1e-4, msg=target)


def test_cli_lists_primitives(capsys):
    from slapo.cli import main

    assert main(["primitives"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line}
    assert {"replace", "checkpoint", "fork_rng", "annotate", "sync", "hook"} <= listed
