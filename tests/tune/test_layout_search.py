"""Layouts as tuning symbols: tp, pp and dp trials launched under torchrun on dp * tp * pp
processes, layouts pruned by --max-procs and by the per-rank memory estimate before any trial, and
one real tuning run of two layouts of `slapo train`."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slapo.tune import Database, Space, Tuner
from slapo.tune.launch import check_launchable, launch_argv, layout_processes
from slapo.tune.trial import failure_reason, run_trial
from slapo.tune.tune_cli import load_update_space, main, parse_training_args

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tune_layouts.py"
TINY = ["--model", "llama", "--seq-len", "16", "--batch-size", "2", "--steps", "3"]
QUIET = [
    "--baseline-steps",
    "0",
    "--no-sample",
    "--no-tensorboard",
    "--no-progress",
    "--json",
    "--compile-model",
    "false",
]
RUN = ["-m", "torch.distributed.run"]


# ----- (a) the launch: prefix and flags of a layout, no process started -----------------------
def test_a_layout_runs_slapo_train_under_torchrun_on_dp_tp_pp_processes():
    cfg = {"tp": 2, "pp": 2, "dp": 2, "num_microbatches": 4, "pipeline_schedule": "GPipe"}
    argv = launch_argv(["slapo", "train", "--steps", "3"], cfg, port=29517)
    assert argv == [
        sys.executable, *RUN, "--nproc-per-node", "8", "--master-port", "29517",
        "-m", "slapo", "train", "--steps", "3",
        "--tp", "2", "--pp", "2", "--num-microbatches", "4", "--pipeline-schedule", "GPipe",
    ]  # fmt: skip
    assert "--dp" not in argv  # dp is the process count, not a slapo train flag
    # `python -m slapo train` keeps its interpreter (and its options)
    argv = launch_argv(["/opt/py", "-X", "utf8", "-m", "slapo", "train"], {"dp": 2}, port=1)
    assert argv == ["/opt/py", "-X", "utf8", *RUN, "--nproc-per-node", "2", "--master-port", "1",
                    "-m", "slapo", "train"]  # fmt: skip
    # a free port of 127.0.0.1 when none is given (torchrun's default, 29500, may be taken)
    argv = launch_argv(["slapo", "train"], {"tp": 1})
    assert 0 < int(argv[argv.index("--master-port") + 1]) < 65536


def test_processes_count_the_command_flags_and_plain_configs_run_as_they_are():
    assert layout_processes({"tp": 2}, ["slapo", "train", "--pp", "2"]) == 4
    assert layout_processes({"dp": 2}, ["slapo", "train", "--num-stages=2", "--tp", "2"]) == 8
    assert layout_processes({"ckpt_ratio": 0.5}, ["slapo", "train", "--tp", "2"]) is None
    cmd = [sys.executable, "train.py", "--gpus", "2"]
    assert launch_argv(cmd, {"batch_size": 8}) == [*cmd, "--batch-size", "8"]
    # any other command runs under --no-python, with the flags but dp
    argv = launch_argv(cmd, {"dp": 2, "tp": 2}, port=7)
    assert argv[argv.index("--no-python") :] == ["--no-python", *cmd, "--tp", "2"]
    assert argv[argv.index("--nproc-per-node") + 1] == "4"
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive int"):
            layout_processes({"tp": bad})


def test_a_command_that_launches_itself_or_a_bad_layout_is_refused_before_any_trial():
    with pytest.raises(ValueError, match="drop the launcher"):
        check_launchable(["torchrun", "--nproc-per-node", "2", "-m", "slapo", "train"])
    with pytest.raises(ValueError, match="drop the launcher"):
        check_launchable([sys.executable, "-m", "torch.distributed.run", "train.py"])
    check_launchable(["slapo", "train", "--tp", "2"])  # the tuner's own launch: fine
    from slapo.tune import TuneError

    with pytest.raises(TuneError, match="drop the launcher"):
        Tuner([{"tp": 2}], ["torchrun", "-m", "slapo", "train"], Database(), progress=False)
    with pytest.raises(TuneError, match="positive int"):
        Tuner([{"dp": 0}], ["slapo", "train"], Database(), progress=False)


def test_the_reason_of_a_failed_layout_is_what_its_workers_said():
    # what torchrun prints after a worker exits on an invalid layout (1F1B with 1 microbatch)
    stderr = (
        "slapo train: pipeline: Number of microbatches (1) must be greater than or equal to the "
        "number of stages (2).\n"
        "W1125 20:41:39.812000 4354 torch/distributed/elastic/multiprocessing/api.py:1028] "
        "Sending process 4359 closing signal SIGTERM\n"
        "Traceback (most recent call last):\n  ...\nChildFailedError:\n=====\nslapo FAILED\n"
    )
    assert failure_reason(stderr).startswith("slapo train: pipeline: Number of microbatches (1)")


def test_max_procs_skips_the_wide_layouts_before_any_trial(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    config.write_text(
        "def update_space(args, space):\n"
        "    space.create_symbol('tp', [1, 2])\n"
        "    space.create_symbol('dp', [1, 2])\n"
        "    return space\n"
    )
    db = tmp_path / "db.json"
    # a trial that would run exits at once: only tp1 x dp1 fits one process, and it fails
    argv = ["--config", str(config), "--db", str(db), "--no-progress", "--max-procs", "1",
            "--", sys.executable, "-c", "import sys; sys.exit('not a trainer')"]  # fmt: skip
    assert main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[0] tp=1, dp=1  [1 process]"
    assert out[3] == "[3] tp=2, dp=2  [4 processes: over --max-procs 1, skipped]"
    assert out[-1] == "4 configurations, 3 over --max-procs 1"
    assert main(argv) == 1  # no trial succeeded
    records = [r for _, r in Database(db).items()]
    skipped = {
        (r["config"]["tp"], r["config"]["dp"]): r for r in records if r["status"] == "skipped"
    }
    assert set(skipped) == {(1, 2), (2, 1), (2, 2)}
    assert skipped[(2, 2)]["error"] == "needs 4 processes (dp * pp * cp * tp), over --max-procs 1"
    (ran,) = (r for r in records if r["status"] != "skipped")
    assert ran["config"] == {"tp": 1, "dp": 1} and ran["processes"] == 1
    assert ran["error"] == "exited with code 1: not a trainer"  # the reason, through torchrun


# ----- (b) --memory-budget prunes layouts per rank, before any trial ---------------------------
@pytest.mark.slow
def test_memory_budget_keeps_the_sharded_layouts_and_drops_the_unsharded(tmp_path, capsys):
    from slapo.cli import main as slapo_main
    from slapo.train.train_cli import train_estimator

    command = [sys.executable, "-m", "slapo", "train", *TINY, *QUIET]
    cfgs = list(Space(load_update_space(str(EXAMPLE)), parse_training_args(command)))
    assert len(cfgs) == 10  # tp, pp, dp in {1, 2}, tp*pp*dp <= 4; batch 2: 2 microbatches only
    estimate = train_estimator(command)
    plain = estimate({"tp": 1, "pp": 1, "dp": 1}).required
    # the rank that needs the most of a dp2 replica holds DDP's buckets too: more than one process
    assert estimate({"tp": 1, "pp": 1, "dp": 2}).required > plain
    budget = int(plain * 0.8)
    unsharded = [i for i, c in enumerate(cfgs) if c["tp"] == c["pp"] == 1]
    db = tmp_path / "db.json"
    argv = ["tune", "--config", str(EXAMPLE), "--db", str(db), "--dry-run",
            "--memory-budget", str(budget), "--", *command]  # fmt: skip
    assert slapo_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"10 configurations, {len(unsharded)} over the memory budget"
    for i, cfg in enumerate(cfgs):
        procs = cfg.get("dp", 1) * cfg["tp"] * cfg["pp"]
        plural = "es" if procs > 1 else ""
        assert lines[i].startswith(
            f"[{i}] {Space.cfg_dict_to_str(cfg)}  [{procs} process{plural}; "
        )
        # per rank, pp and tp sharding fit a budget one unsharded process does not
        assert lines[i].endswith("over budget, skipped]") == (i in unsharded), lines[i]
    assert not db.exists()  # nothing ran, nothing recorded

    # the tuner records the reasons of the same verdicts; no trial runs (--max-procs 1 leaves
    # tp1 x pp1 x dp1 alone, and the budget drops it)
    argv = ["tune", "--config", str(EXAMPLE), "--db", str(db), "--no-progress", "--max-procs",
            "1", "--memory-budget", str(budget), "--", *command]  # fmt: skip
    assert slapo_main(argv) == 1
    records = {json.dumps(r["config"], sort_keys=True): r for _, r in Database(db).items()}
    assert len(records) == 10 and all(r["status"] == "skipped" for r in records.values())
    (over_budget,) = (r for r in records.values() if "memory_budget" in r)
    assert over_budget["config"] == {"tp": 1, "pp": 1, "dp": 1}
    assert "exceeds the memory budget" in over_budget["error"]
    assert over_budget["estimate"]["required"] == plain > budget


# ----- (c) one real tuning run of two layouts ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_layouts_of_slapo_train_run_under_torchrun_and_are_recorded(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    config.write_text("def update_space(args, space):\n    space.create_symbol('tp', [1, 2])\n")
    db = tmp_path / "db.json"
    command = [sys.executable, "-m", "slapo", "train", *TINY, *QUIET,
               "--output-dir", str(tmp_path / "run")]  # fmt: skip
    argv = ["--config", str(config), "--db", str(db), "--no-progress", "--timeout", "100",
            "--plot", str(tmp_path / "plot.png"), "--", *command]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr()
    records = sorted((r for _, r in Database(db).items()), key=lambda r: r["config"]["tp"])
    assert [r["config"] for r in records] == [{"tp": 1}, {"tp": 2}]
    for rec in records:
        assert rec["status"] == "ok", rec.get("output_tail")
        assert rec["processes"] == rec["config"]["tp"]  # one process per rank of the layout
        assert rec["result"]["throughput"] > 0 and rec["result"]["final_loss"] > 0
    # the tp2 trial trained 2 ranks: each holds half of the sharded weights, as the summary says
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "tp 2" in json.dumps(metrics), metrics.keys()


# ----- a launched trial is stopped whole: torchrun's workers too -------------------------------
WORKER = """
import os, sys, time
open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_timed_out_layout_trial_stops_torchruns_workers(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    command = [sys.executable, str(worker), str(tmp_path)]

    start = time.monotonic()
    res = run_trial(command, {"dp": 2}, timeout=10)  # dp alone: no flag, 2 processes
    assert res.status == "timeout" and res.extra == {"processes": 2}, res
    assert time.monotonic() - start < 10 + 15  # SIGTERM, torchrun's bounded teardown
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "torchrun's workers outlived the stopped trial"


def test_docstring_examples_of_the_launch_module():
    import doctest

    import slapo.tune.launch

    result = doctest.testmod(slapo.tune.launch, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
