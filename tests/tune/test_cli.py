"""`slapo tune` end to end: real trials, failures recorded once, resume, table and plot."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter

from slapo.tune import Database
from slapo.tune.tune_cli import add_parser, main


def _argv(project, *extra: str) -> list[str]:
    return [
        "--config",
        str(project.config),
        "--db",
        str(project.db),
        "--timeout",
        "1",
        "--no-progress",
        *extra,
        "--",
        *project.command,
    ]


def test_exhaustive_run_records_every_outcome_then_resume_runs_nothing(project, capsys):
    assert main(_argv(project)) == 0
    out = capsys.readouterr().out
    records = Database(project.db).items()
    assert len(records) == 10
    status = Counter(rec["status"] for _, rec in records)
    assert status == {"ok": 5, "failed": 2, "timeout": 2, "oom": 1}
    lines = out.splitlines()
    assert lines[0].split() == ["rank", "trial", "throughput", "config"]
    assert lines[1].split()[2:] == ["51.2", "batch_size=64,", "ckpt=True"]
    assert "10 trials: 5 ok, 2 failed, 1 oom, 2 timeout" in out
    png = project.db.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(project.runs()) == 10

    # Same database again: nothing is re-run, failures and timeouts included.
    assert main(_argv(project)) == 0
    assert len(project.runs()) == 10
    assert "51.2" in capsys.readouterr().out


def test_budget_then_resume_measures_each_config_exactly_once(project):
    assert main(_argv(project, "--strategy", "random", "--seed", "1", "--budget", "4")) == 0
    first = project.runs()
    assert len(first) == 4 and len(Database(project.db)) == 4
    assert main(_argv(project, "--strategy", "random", "--seed", "1")) == 0
    runs = [json.dumps(r, sort_keys=True) for r in project.runs()]
    assert len(runs) == 10 and len(set(runs)) == 10
    trials = sorted(rec["trial"] for _, rec in Database(project.db).items())
    assert trials == list(range(1, 11))


def test_bayes_minimize_with_a_custom_plot_path(project, capsys):
    plot = project.root / "search.png"
    argv = _argv(
        project,
        "--strategy",
        "bayes",
        "--budget",
        "6",
        "--objective",
        "throughput",
        "--direction",
        "minimize",
        "--plot",
        str(plot),
        "--top",
        "2",
    )
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(project.runs()) == 6 and plot.exists()
    table = out.splitlines()[1:3]
    values = [float(row.split()[2]) for row in table if row[:1].isdigit()]
    assert values == sorted(values)  # minimizing: the smallest first


def test_add_parser_wires_tune_into_a_parent_cli(project):
    parser = argparse.ArgumentParser(prog="slapo")
    sub = parser.add_subparsers(dest="command", required=True)  # as in slapo.cli
    add_parser(sub)
    args = parser.parse_args(["tune", *_argv(project, "--budget", "2")])
    assert args.trial_command[-2:] == ["--log", str(project.log)]
    assert args.func(args) == 1  # the first two configurations (batch size 3) both fail
    assert len(project.runs()) == 2


def test_module_entry_point_dry_run(project):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slapo.tune.tune_cli",
            "--config",
            str(project.config),
            "--db",
            str(project.db),
            "--dry-run",
            "--",
            *project.command,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "10 configurations" in proc.stdout and "batch_size=64, ckpt=False" in proc.stdout
    assert not project.db.exists() and project.runs() == []


def test_user_errors_exit_2_with_a_message(project, capsys):
    project.db.write_text("{not json")
    assert main(_argv(project)) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert project.db.read_text() == "{not json"  # never overwritten

    bad_cfg = project.root / "empty_cfg.py"
    bad_cfg.write_text("x = 1\n")
    argv = ["--config", str(bad_cfg), "--db", str(project.root / "x.json"), "--", *project.command]
    assert main(argv) == 2
    assert "update_space" in capsys.readouterr().err

    assert main(["--config", str(project.config), "--db", str(project.db), "--"]) == 2
    assert "training command" in capsys.readouterr().err
    argv = ["--config", str(project.config), "--db", "y.json", "--", "no-such-program-xyz"]
    assert main(argv) == 2
    assert "command not found" in capsys.readouterr().err
    assert project.runs() == []


def test_all_trials_failing_exits_1(project, tmp_path):
    cfg = tmp_path / "fail_cfg.py"
    cfg.write_text(
        "def update_space(args, space):\n    space.create_symbol('batch_size', [3])\n"
        "    space.create_symbol('ckpt', [True])\n"
    )
    argv = ["--config", str(cfg), "--db", str(project.db), "--no-progress", "--", *project.command]
    assert main(argv) == 1
    assert Database(project.db).items()[0][1]["status"] == "failed"
