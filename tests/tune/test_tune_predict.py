"""``slapo tune --predict``: trials ordered by the planner's predicted tokens/s, those predicted
not to fit the device skipped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from slapo.cli import main as slapo_main
from slapo.tune.predict import rank_by_prediction

pytest.importorskip("transformers")


class _Predicted:
    def __init__(self, tokens: float) -> None:
        self.tokens_per_s_per_gpu = tokens


def test_rank_by_prediction_fastest_first_unknown_last() -> None:
    configs = [{"bs": 1}, {"bs": 4}, {"bs": 0}, {"bs": 2}]

    def predict(cfg):
        if cfg["bs"] == 0:
            raise ValueError("no prediction")
        return _Predicted(cfg["bs"] * 10.0)

    ranked, predictions = rank_by_prediction(configs, predict)
    assert [c["bs"] for c in ranked] == [4, 2, 1, 0]
    assert predictions[0].tokens_per_s_per_gpu == 40.0 and predictions[3] is None


def tune_main(argv: list[str]) -> int:
    return slapo_main(["tune", *argv])


def test_dry_run_lists_the_space_fastest_predicted_first(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    config = tmp_path / "space.py"
    config.write_text(
        "def update_space(args, space):\n"
        "    space.create_symbol('ckpt_ratio', [1.0, 0.0])\n"
        "    space.create_symbol('batch_size', [2, 8])\n"
        "    return space\n"
    )
    bindir = str(Path(sys.executable).parent)  # the slapo command of this environment
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ.get("PATH", ""))
    code = tune_main([
        "--config", str(config), "--db", str(tmp_path / "db.json"), "--predict", "h100",
        "--dry-run", "--", "slapo", "train", "--model", "llama", "--steps", "2",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("[")]
    # no recompute and the larger batch first (more tokens per step at the same overheads)
    assert "ckpt_ratio=0.0, batch_size=8" in lines[0]
    assert "ckpt_ratio=1.0" in lines[-1] or "batch_size=2" in lines[-1]


def test_predict_needs_slapo_train(tmp_path: Path, capsys) -> None:
    config = tmp_path / "space.py"
    config.write_text("def update_space(args, space):\n    space.create_symbol('x', [1])\n")
    code = tune_main([
        "--config", str(config), "--db", str(tmp_path / "db.json"), "--predict", "h100",
        "--dry-run", "--", sys.executable, "-c", "pass",
    ])  # fmt: skip
    assert code == 2 and "--predict needs a slapo train command" in capsys.readouterr().err
