"""``slapo estimate``: the estimate of what ``slapo train`` would run with the same flags."""

from __future__ import annotations

import json

import pytest

from slapo.cli import main

SMALL = ["--model", "opt", "--batch-size", "2", "--seq-len", "32"]


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_estimate_prints_a_table_and_json(capsys):
    assert main(["estimate", *SMALL, "--ckpt-ratio", "1.0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slapo estimate: opt (tiny), batch 2 x 32 tokens, ckpt_ratio 1.0")
    assert "optimizer state" in out and "activations by block:" in out
    assert main(["estimate", *SMALL, "--json", "--optimizer", "sgd"]) == 0
    doc = _json(capsys)["estimate"]
    assert doc["optimizer"] == "SGD" and doc["optimizer_state"] == 0  # no momentum: no state
    assert doc["peak"] == sum(
        doc[k] for k in ("params", "buffers", "grads", "optimizer_state", "activations")
    )


def test_compare_tensor_parallel_rank_and_budget(capsys):
    assert main(["estimate", *SMALL, "--compare", "--json"]) == 0
    doc = _json(capsys)
    assert doc["scheduled"]["activations"] < doc["unscheduled"]["activations"]  # ckpt 0.5
    assert main(["estimate", *SMALL, "--tp", "2", "--rank", "1", "--json"]) == 0
    rank = _json(capsys)["estimate"]
    assert (rank["rank"], rank["world_size"]) == (1, 2)
    assert rank["params"] < 0.8 * doc["scheduled"]["params"]  # a shard of the weights
    need = doc["scheduled"]["required"]
    assert main(["estimate", *SMALL, "--memory-budget", str(need)]) == 0
    assert "fits the memory budget" in capsys.readouterr().out
    assert main(["estimate", *SMALL, "--memory-budget", str(need - 1)]) == 1
    assert "does NOT fit the memory budget" in capsys.readouterr().out


def test_bad_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--memory-budget", "lots"])
    assert exc.value.code == 2 and "cannot read 'lots' as a memory size" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="rank must lie in"):
        main(["estimate", *SMALL, "--tp", "2", "--rank", "2"])


def test_a_compare_run_needs_what_its_larger_run_needs():
    from slapo.train import TrainConfig
    from slapo.train.run_memory import estimate_config

    small = {"model": "opt", "batch_size": 2, "seq_len": 32}
    both = estimate_config(TrainConfig(compare=True, **small))
    plain = estimate_config(TrainConfig(unscheduled=True, **small))
    scheduled = estimate_config(TrainConfig(**small))
    assert both.as_dict() == plain.as_dict() and scheduled.required < plain.required
    ddp = estimate_config(TrainConfig(target="ddp", **small), dp=2)  # every target is modelled
    assert ddp.target == "ddp" and ddp.engine == ddp.grads == scheduled.grads


def test_layout_flags_estimate_one_rank(capsys):
    args = [*SMALL, "--model", "gpt2", "--target", "fsdp", "--dp", "2", "--pp", "2", "--json"]
    args += ["--num-microbatches", "2", "--pipeline-schedule", "GPipe"]
    main(["estimate", *args, "--rank", "0"])
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    main(["estimate", *args, "--rank", "2"])  # dp rank 1 of the same stage: the same share
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    main(["estimate", *args, "--rank", "1"])  # the last stage
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    assert (first["target"], first["stage"], last["stage"]) == ("fsdp", 0, 1)
    assert first["layout"] == {"dp": 2, "pp": 2, "tp": 1} and first["peak"] == again["peak"]
    assert first["engine_parts"]["fsdp gathered parameters"] > 0 and first["peak"] != last["peak"]


def test_pipeline_replicas_hold_no_ddp_buckets():
    """The pipeline's DDP-style replicas all-reduce through a temporary buffer: no ``engine``
    bytes, a transient of at most one bucket in ``live_peak``; FSDP2 replicas hold the stage
    gathered, and the flat all-gather output it came from."""
    from slapo.memory.targets import PIPELINE_REPLICA_BUCKET_BYTES
    from slapo.pipeline.replicas import BUCKET_BYTES
    from slapo.train import TrainConfig
    from slapo.train.run_memory import estimate_config

    assert PIPELINE_REPLICA_BUCKET_BYTES == BUCKET_BYTES
    cfg = {"model": "gpt2", "batch_size": 4, "seq_len": 32, "pp": 2, "num_microbatches": 2}
    alone = estimate_config(TrainConfig(**cfg), rank=0)
    ddp = estimate_config(TrainConfig(**cfg), rank=0, dp=2)
    assert (ddp.target, alone.target) == ("ddp", "pipeline")
    assert ddp.engine == 0 and ddp.engine_parts == {} and ddp.peak == alone.peak
    held = ddp.params + ddp.buffers + ddp.grads + ddp.optimizer_state
    assert ddp.live_peak >= held + min(ddp.grads, BUCKET_BYTES)
    fsdp = estimate_config(TrainConfig(target="fsdp", **cfg), rank=0, dp=2)
    gathered = fsdp.engine_parts["fsdp gathered parameters"]
    # the unsharded stage and the all-gather's flat output
    assert gathered == 4 * fsdp.params and 2 * alone.params <= gathered < 2.02 * alone.params


def test_engine_bytes_of_a_plain_module_are_none():
    from torch import nn

    from slapo.memory import EngineBytes

    engine = EngineBytes(nn.Linear(4, 4))
    engine.sample()
    assert engine.kind is None and engine.parts() == {} and engine.skip() == set()
