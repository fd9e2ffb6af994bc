"""``slapo plan`` as a user runs it: text, JSON, one named layout, typed errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slapo.cli import main
from slapo.plan.models import MODEL_SIZES, model_config, write_model_config
from slapo.plan.step_time import PlanError

pytest.importorskip("transformers")


def test_text_ranks_layouts_with_their_commands(small_llama: str, capsys) -> None:
    code = main([
        "plan", "--model", small_llama, "--gpus", "2", "--seq-len", "64", "--global-batch", "4",
        "--ac", "none", "--top", "2",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "layouts fit" in out and out.count("torchrun --nproc-per-node") == 2
    assert "tokens/s/GPU" in out and "MFU" in out


def test_json_has_every_prediction(small_llama: str, capsys) -> None:
    code = main([
        "plan", "--model", small_llama, "--gpus", "2", "--seq-len", "64", "--global-batch", "4",
        "--ac", "full", "--json",
    ])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and rows
    for row in rows:
        assert row["dp"] * row["tp"] * row["pp"] * row["cp"] == 2
        assert row["memory_bytes"] > 0 and row["step_seconds"] > 0 and 0 < row["mfu"] < 1
        assert row["command"].startswith("torchrun") and row["ac"] == "full"


def test_one_named_layout(small_llama: str, capsys) -> None:
    code = main([
        "plan", "--model", small_llama, "--gpus", "4", "--seq-len", "64",
        "--layout", "fsdp=2,tp=2,ac=selective", "--json",
    ])  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (row["target"], row["dp"], row["tp"], row["ac"]) == ("fsdp", 2, 2, "selective")
    assert row["batch_size"] == 4  # --global-batch defaults to 2 per GPU: 8 over dp 2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpu", "tpu9"], "--gpu tpu9"),
        (["--layout", "fsdp=3,tp=2"], "is not --gpus"),
        (["--layout", "fsdp=4,schedule=zb"], "schedule=zb"),
        (["--gpus", "0"], "--gpus"),
    ],
)
def test_bad_input_exits_2_naming_it(small_llama: str, capsys, argv, words) -> None:
    assert main(["plan", "--model", small_llama, *argv]) == 2
    assert words in capsys.readouterr().err


def test_model_type_and_size(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--model", "llama", "--size", "9b"]) == 2
    assert "--size 9b" in capsys.readouterr().err
    assert main(["plan", "--model", "falcon", "--size", "7b"]) == 2
    assert main(["plan", "--model", str(tmp_path / "nothing")]) == 2
    path = write_model_config("llama", "70B", tmp_path / "llama-70b")
    written = json.loads((path / "config.json").read_text())
    assert written == model_config("llama", "70b")
    assert (written["hidden_size"], written["num_hidden_layers"]) == (8192, 80)
    with pytest.raises(PlanError, match="known"):
        model_config("nosuch", "1b")
    assert set(MODEL_SIZES) >= {"llama", "qwen3", "mixtral", "gpt2"}


def test_llama_8b_fsdp_on_8_gpus(tmp_path: Path, capsys) -> None:
    # torchtitan's layout (FSDP 8, local batch 2, sequence 8192) on its 96 GB H100s
    code = main([
        "plan", "--model", "llama", "--size", "8b", "--config-dir", str(tmp_path / "l8"),
        "--gpus", "8", "--gpu", "h100-96gb-hbm2e-500w", "--json",
        "--layout", "fsdp=8,batch=2,ac=selective-narrow",
    ])  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0 and row["fits"]
    assert 40 < row["memory_gib"] < 80 and 3000 < row["tokens_per_s_per_gpu"] < 9000
    assert f"--model {tmp_path / 'l8'}" in row["command"]
