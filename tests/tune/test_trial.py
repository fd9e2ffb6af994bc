"""run_trial on real subprocesses: success, failure, out of memory, timeout."""

from __future__ import annotations

import sys
import time

import pytest

from slapo.tune import config_to_flags, run_trial
from slapo.tune.trial import last_json_line


def test_flags_use_dashes():
    assert config_to_flags({"micro_batch_size": 4, "fuse": False}) == [
        "--micro-batch-size",
        "4",
        "--fuse",
        "False",
    ]


def test_last_json_line_skips_noise():
    out = '{"throughput": 1}\nlog {not json}\n{"throughput": 2, "x": [1]}\n[1, 2]\n{broken\n'
    assert last_json_line(out) == {"throughput": 2, "x": [1]}
    assert last_json_line("no json here") is None


def test_ok_failed_and_oom(project):
    ok = run_trial(project.command, {"batch_size": 8, "ckpt": True})
    assert ok.status == "ok" and ok.objective == pytest.approx(6.4)
    assert ok.result == {"throughput": pytest.approx(6.4), "mem": 1}
    bad = run_trial(project.command, {"batch_size": 3, "ckpt": True})
    assert bad.status == "failed" and bad.returncode == 1 and "boom" in bad.output_tail
    oom = run_trial(project.command, {"batch_size": 64, "ckpt": False})
    assert oom.status == "oom" and oom.objective is None
    missing = run_trial(project.command, {"batch_size": 8, "ckpt": True}, objective="latency")
    assert missing.status == "failed" and "latency" in missing.error


def test_no_json_line_is_a_failure():
    res = run_trial([sys.executable, "-c", "print('hello')"], {})
    assert res.status == "failed" and "no JSON" in res.error


def test_timeout_kills_the_trial_and_its_children(tmp_path):
    marker = tmp_path / "child-alive"
    # The trial starts a grandchild that would write a file after 2 s, then hangs.
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w').close()\n")
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    res = run_trial([sys.executable, "-c", script], {}, timeout=0.7)
    assert res.status == "timeout" and "0.7" in res.error
    assert time.monotonic() - start < 10
    time.sleep(2.5)
    assert not marker.exists()


def test_bad_arguments():
    with pytest.raises(ValueError, match="command"):
        run_trial([], {})
    with pytest.raises(ValueError, match="timeout"):
        run_trial([sys.executable], {}, timeout=0)
