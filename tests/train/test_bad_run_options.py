"""Bad checkpoint, learning-rate and evaluation flags of `slapo train`: one line on stderr naming
the flag, exit status 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from slapo.cli import main
from slapo.train import TrainConfig, train

QUICK = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--baseline-steps", "0",
         "--no-progress", "--no-sample", "--compile-model", "false"]  # fmt: skip


def _fails(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """Run `slapo train argv`; assert the bad-input contract; return the stderr line."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *QUICK, *argv, "--output-dir", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slapo train: "), err
    assert "Traceback" not in err and not out.exists()
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step llama checkpoint."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    train(TrainConfig(steps=2, batch_size=2, seq_len=16, baseline_steps=0, progress=False,
                      sample=False, compile_model=False, save=str(path)))  # fmt: skip
    return path


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--keep", "0"], "--keep must be positive, got 0"),
        (["--save-every", "5"], "--save-every 5 needs --save DIR"),
        (["--eval-fraction", "0"], "--eval-fraction must be between 0 and 1"),
        (["--eval-fraction", "1.5"], "--eval-fraction must be between 0 and 1"),
        (
            ["--lr-schedule", "step"],
            "--lr-schedule must be one of ('constant', 'cosine', 'linear')",
        ),
        (["--warmup-steps", "-1"], "--warmup-steps must be 0 or more"),
        (["--eval-every", "5"], "--eval-every 5 needs eval data"),
        (["--eval-fraction", "0.999999"], "leaves 4 tokens for training"),
    ],
)
def test_a_bad_flag(tmp_path, capsys, argv, says):
    assert says in _fails(argv, tmp_path, capsys)


def test_resume_from_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("a user's file: not an empty run directory")
    line = _fails(["--resume", str(tmp_path / "notes")], tmp_path, capsys)
    assert f"--resume {tmp_path / 'notes'} is not a `slapo train --save` checkpoint" in line


def test_resume_from_a_missing_directory_starts_fresh_then_resumes(tmp_path, capsys):
    """One command for the first start and every restart (``torchrun --max-restarts``): a
    --resume directory that does not exist yet (or holds only a killed save's leftovers) starts
    from step 0 with one line saying so; the same command later resumes from its checkpoint."""
    ckpt = tmp_path / "ckpt"
    first = train(TrainConfig(steps=2, batch_size=2, seq_len=16, baseline_steps=0,
                              progress=False, sample=False, compile_model=False,
                              save=str(ckpt), resume=str(ckpt)))  # fmt: skip
    err = capsys.readouterr().err
    assert f"--resume {ckpt}: no checkpoint there yet; starting from step 0" in err
    assert first["resumed_from"] is None and len(first["losses"]) == 2
    more = train(TrainConfig(steps=3, batch_size=2, seq_len=16, baseline_steps=0,
                             progress=False, sample=False, compile_model=False,
                             save=str(ckpt), resume=str(ckpt)))  # fmt: skip
    assert "no checkpoint there yet" not in capsys.readouterr().err
    assert more["resumed_at"] == 2 and more["losses"][:2] == first["losses"]


def test_resume_from_a_directory_with_only_a_killed_save_starts_fresh(tmp_path, capsys):
    (tmp_path / "ckpt" / "step-000002.tmp-train").mkdir(parents=True)  # killed mid-save
    summary = train(TrainConfig(steps=1, batch_size=2, seq_len=16, baseline_steps=0,
                                progress=False, sample=False, compile_model=False,
                                resume=str(tmp_path / "ckpt")))  # fmt: skip
    assert "no checkpoint there yet" in capsys.readouterr().err
    assert summary["resumed_from"] is None


def test_resume_with_another_model(tmp_path, capsys, saved):
    line = _fails(["--model", "gpt2", "--resume", str(saved), "--steps", "4"], tmp_path, capsys)
    assert f"--resume {saved} holds a llama model" in line and "--model gpt2" in line


def test_resume_with_another_preset(tmp_path, capsys, saved):
    line = _fails(["--preset", "small", "--resume", str(saved), "--steps", "4"], tmp_path, capsys)
    assert "holds a llama model" in line and "--preset small" in line


def test_resume_of_a_run_that_trained_its_steps(tmp_path, capsys, saved):
    line = _fails(["--resume", str(saved)], tmp_path, capsys)  # --steps 2: done already
    assert "has trained 2 steps already; pass a --steps beyond it" in line


def test_save_into_a_directory_of_other_files(tmp_path, capsys, llama_dir):
    line = _fails(["--model", str(llama_dir), "--save", str(llama_dir)], tmp_path, capsys)
    assert f"--save {llama_dir} holds files that are not a slapo train checkpoint" in line
    assert (llama_dir / "config.json").is_file()  # untouched
