"""``slapo tune --memory-budget``: configurations whose estimated memory exceeds the budget are
recorded as skipped and never run; the estimates come from real fake-tensor runs of real models
(slapo.estimate_memory), the trials are real subprocesses whose starts are logged."""

from __future__ import annotations

import sys
import textwrap

import pytest

from slapo.tune import Database
from slapo.tune.tune_cli import main

# A real model per configuration: an MLP whose activations grow with the batch size, and shrink
# when its blocks are checkpointed; estimate_memory runs it on fake tensors.
ESTIMATING_CFG = """
import torch
import slapo

def update_space(args, space):
    space.create_symbol("batch_size", [2, 8, 64])
    space.create_symbol("ckpt", [True, False])
    return space

def estimate_memory(args, cfg):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 64)) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    sch = slapo.create_schedule(model)
    if cfg["ckpt"]:
        for i in range(4):
            sch[str(i)].checkpoint()
    x = torch.randn(cfg["batch_size"], 16, 64)
    batch = (x, torch.zeros_like(x))
    return slapo.estimate_memory(sch, batch, loss_fn=torch.nn.functional.mse_loss)
"""


def _load(path):
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # the config, as the tuner does
    return namespace["estimate_memory"]


def _argv(project, budget, *extra):
    return [
        "--config", str(project.config), "--db", str(project.db), "--timeout", "30",
        "--no-progress", "--memory-budget", str(budget), *extra, "--", *project.command,
    ]  # fmt: skip


@pytest.fixture
def estimating(project):
    project.config.write_text(textwrap.dedent(ESTIMATING_CFG))
    estimate = _load(project.config)
    needs = {
        (bs, ckpt): estimate(None, {"batch_size": bs, "ckpt": ckpt}).required
        for bs in (2, 8, 64)
        for ckpt in (True, False)
    }
    return project, needs


def test_configurations_over_the_budget_never_run(estimating, capsys):
    project, needs = estimating
    assert needs[(64, True)] < needs[(64, False)]  # checkpointing shows in the estimate
    # a budget between the two checkpointing choices of batch 64: one fits, the other not
    budget = (needs[(64, True)] + needs[(64, False)]) // 2
    over = {cfg for cfg, need in needs.items() if need > budget}
    assert over and len(over) < len(needs)
    assert main(_argv(project, budget)) == 0
    ran = {(r["batch_size"], r["ckpt"]) for r in project.runs()}
    assert ran.isdisjoint(over) and ran | over == set(needs)
    records = dict(Database(project.db).items())
    skipped = {
        (r["config"]["batch_size"], r["config"]["ckpt"])
        for r in records.values()
        if r["status"] == "skipped"
    }
    assert skipped == over
    for r in records.values():
        if r["status"] == "skipped":
            assert "exceeds the memory budget" in r["error"]
            assert r["estimate"]["required"] > budget == r["memory_budget"]
    out = capsys.readouterr().out
    assert f"{len(over)} configurations skipped" in out
    assert f"{len(needs) - len(over)} trials: {len(needs) - len(over)} ok" in out

    # A larger budget later: the skipped configurations run, the measured ones do not again.
    assert main(_argv(project, max(needs.values()))) == 0
    runs = [(r["batch_size"], r["ckpt"]) for r in project.runs()]
    assert sorted(runs) == sorted(needs) and len(runs) == len(set(runs))
    status = {(r["config"]["batch_size"], r["config"]["ckpt"]): r["status"]
              for _, r in Database(project.db).items()}  # fmt: skip
    # the training script runs out of memory at batch 64 without checkpointing, as estimated
    assert status.pop((64, False)) == "oom" and set(status.values()) == {"ok"}


def test_dry_run_shows_each_estimate_and_runs_nothing(estimating, capsys):
    project, needs = estimating
    budget = min(needs.values())  # only the smallest fits
    assert main(_argv(project, budget, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert out.count("over budget, skipped") == len(needs) - 1
    assert f"{len(needs)} configurations, {len(needs) - 1} over the memory budget" in out
    assert project.runs() == [] and not project.db.exists()


def test_slapo_train_trials_are_estimated_by_slapo(tmp_path, capsys):
    # The estimate of a `slapo train` command needs no estimate_memory in the config: slapo
    # builds what the trial would (model, schedule, AdamW, batch) and estimates it. (That such a
    # run then measures what was estimated: tests/memory/test_estimate_train_report.py.)
    from slapo.cli import main as slapo_main
    from slapo.train.train_cli import train_estimator

    config = tmp_path / "cfg.py"
    config.write_text(
        "def update_space(args, space):\n"
        "    space.create_symbol('ckpt_ratio', [0.0, 1.0])\n"
        "    return space\n"
    )
    command = [
        sys.executable, "-m", "slapo", "train", "--model", "opt", "--steps", "2",
        "--batch-size", "4", "--seq-len", "64", "--no-progress", "--json",
    ]  # fmt: skip
    estimate = train_estimator(command)
    plain, ckpt = (estimate({"ckpt_ratio": r}).required for r in (0.0, 1.0))
    assert ckpt < plain
    db = tmp_path / "db.json"
    argv = [
        "--config", str(config), "--db", str(db), "--dry-run",
        "--memory-budget", str((plain + ckpt) // 2), "--", *command,
    ]  # fmt: skip
    assert slapo_main(["tune", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[0] ckpt_ratio=0.0") and lines[0].endswith("skipped]")
    assert lines[1].startswith("[1] ckpt_ratio=1.0") and "over budget" not in lines[1]
    assert lines[2] == "2 configurations, 1 over the memory budget"
    assert not db.exists()


def test_a_budget_without_an_estimate_is_a_clear_error(project, capsys):
    assert main(_argv(project, "1GiB")) == 2  # the fixture's config has no estimate_memory
    assert "define estimate_memory(args, cfg)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_argv(project, "8 gigs"))
    assert "cannot read '8 gigs' as a memory size" in capsys.readouterr().err
    assert project.runs() == []


def test_docstring_examples_of_the_memory_module():
    import doctest

    import slapo.tune.memory_budget

    result = doctest.testmod(slapo.tune.memory_budget, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
