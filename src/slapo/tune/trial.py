"""Run one configuration of a training command in a subprocess and read its result."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import TuneValueError
from .launch import config_to_flags, launch_argv, layout_processes
from .space import Value

__all__ = ["STATUSES", "TrialResult", "config_to_flags", "last_json_line", "run_trial"]

# Messages that PyTorch, CUDA, the Python runtime and the Linux OOM killer leave behind.
_OOM_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|MemoryError|CUBLAS_STATUS_ALLOC_FAILED"
    r"|std::bad_alloc|Cannot allocate memory",
    re.IGNORECASE,
)
_TAIL_CHARS = 2000

#: Statuses of a trial; only "ok" carries an objective value.
STATUSES = ("ok", "failed", "oom", "timeout")


@dataclass
class TrialResult:
    """What one trial produced: a status, the JSON it printed, and a tail of its output."""

    status: str
    result: dict[str, Any] | None = None
    objective: float | None = None
    returncode: int | None = None
    elapsed_s: float = 0.0
    error: str = ""
    output_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """A JSON-serializable dict for the database."""
        rec = asdict(self)
        rec.update(rec.pop("extra"))
        return rec


def last_json_line(output: str) -> dict[str, Any] | None:
    """Return the last line of ``output`` that parses as a JSON object, or None.

    Example:
        >>> last_json_line('step 1\\n{"throughput": 3.5}\\ndone\\n')
        {'throughput': 3.5}
    """
    for line in reversed(output.splitlines()):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


# torchrun's own log lines ("E1125 20:41:39.877000 4354 [path/]torch/distributed/...") and the
# report after them: a launched trial's reason is what its workers wrote before.
_LAUNCHER_LOG = re.compile(
    r"^[IWE]\d{4} \d\d:\d\d:\d\d\S* +\d+ \S*torch/distributed/", re.MULTILINE
)
_REASON_CHARS = 500


def failure_reason(stderr: str) -> str:
    """The reason a trial failed: the last line it wrote to stderr, before torchrun's report.

    Example:
        >>> failure_reason("Traceback ...\\nValueError: --pp 8 exceeds the 4 blocks\\n")
        'ValueError: --pp 8 exceeds the 4 blocks'
        >>> failure_reason("slapo train: bad\\nW1125 20:41:39.812000 43 torch/distributed/x] ...")
        'slapo train: bad'
    """
    launcher = _LAUNCHER_LOG.search(stderr)
    own = stderr[: launcher.start()] if launcher else stderr
    lines = [line.strip() for line in own.splitlines() if line.strip()]
    return lines[-1][:_REASON_CHARS] if lines else ""


# ----- a trial never outlives its tuner ---------------------------------------------------
# Two independent layers, because each alone has a hole:
# 1. PR_SET_PDEATHSIG (Linux): the kernel SIGKILLs the trial the moment the tuner dies, however it
#    dies (SIGKILL included). It reaches only the trial process itself, not what it spawned.
# 2. A guard process per trial, in its own session, blocked reading a pipe whose only writer is
#    the tuner. The tuner writes one byte when it has reaped the trial; if the pipe closes with
#    no byte, the tuner died, and the guard SIGKILLs the trial's whole process group (the trial
#    runs in a new session, so its own children share its group). This works on any POSIX system
#    and covers the trial's children; layer 1 still holds if the guard is killed too.
# A launched trial (torchrun, for a layout) is the exception: torchrun starts each worker in a
# session of its own, out of reach of a group kill, and stops them only when it is asked to stop
# (SIGTERM). So such a trial gets SIGTERM first, from all three (layer 1, the guard, the tuner's
# own stop), and SIGKILL after a bounded grace.
_PR_SET_PDEATHSIG = 1
_REAP_TIMEOUT_S = 10.0  # bounded waits while stopping a trial: never hang the tuner
_LAUNCHER_GRACE_S = 10.0  # torchrun's time to stop its workers before it is killed
_GUARD_CODE = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
if not os.read(0, 1):
    try:
        if grace > 0:
            os.killpg(pgid, signal.SIGTERM)
            time.sleep(grace)
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


def _load_prctl() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved once in the parent: the child, between fork and exec, only calls a C function.
_PRCTL = _load_prctl()


def _die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """``preexec_fn`` of a trial: the kernel sends it ``signum`` when the tuner (its parent) dies."""
    _PRCTL(_PR_SET_PDEATHSIG, signum, 0, 0, 0)  # type: ignore[operator]
    if os.getppid() != parent_pid:  # the tuner died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _start_guard(pgid: int, grace: float = 0.0) -> tuple[subprocess.Popen[bytes], int] | None:
    """Start the guard of process group ``pgid`` (SIGTERM ``grace`` seconds before SIGKILL when
    positive); returns it and the write end of its pipe."""
    read_fd, write_fd = os.pipe()  # not inheritable: the trial never holds the write end
    try:
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD_CODE, str(pgid), str(grace)],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # no terminal signal (Ctrl-C, hangup) reaches it
        )
    except OSError:
        os.close(write_fd)
        return None  # layer 1 (and the tuner's own cleanup) still hold
    finally:
        os.close(read_fd)
    return guard, write_fd


def _release_guard(handle: tuple[subprocess.Popen[bytes], int] | None) -> None:
    """Tell the guard the trial was reaped (so it kills nothing) and reap the guard."""
    if handle is None:
        return
    guard, write_fd = handle
    try:
        os.write(write_fd, b"x")
    except OSError:
        pass  # the guard is gone already
    finally:
        os.close(write_fd)
    try:
        guard.wait(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def _kill_group(proc: subprocess.Popen[str], signum: int = signal.SIGKILL) -> None:
    """Kill the trial and everything it spawned (it runs in its own session)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen[str], grace: float = 0.0) -> tuple[str, str]:
    """Kill the trial's process group and reap it; returns the output read (bounded waits).
    With ``grace``, SIGTERM first, and SIGKILL only if it is still running ``grace`` s later."""
    if grace > 0:
        _kill_group(proc, signal.SIGTERM)
        try:
            return proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc)
    try:
        return proc.communicate(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # A descendant that left the group still holds the pipes: stop reading them.
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.kill()
        proc.wait(timeout=_REAP_TIMEOUT_S)
        return "", ""


def run_trial(
    command: Sequence[str],
    cfg: Mapping[str, Value],
    *,
    objective: str = "throughput",
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> TrialResult:
    """Run ``command`` with the flags of ``cfg`` and classify the outcome.

    A configuration with layout symbols (``tp``, ``pp``, ``dp``) runs under torchrun on
    ``dp * pp * cp * tp`` processes (:func:`slapo.tune.launch.launch_argv`). The result is the last
    JSON object line the command prints to stdout; it must hold a finite number under
    ``objective``. Non-zero exit, an out-of-memory message, a timeout or a missing result are
    failures with a status, the reason (the last line the trial wrote to stderr) and a tail of
    the output.

    Example:
        >>> import sys
        >>> script = "import sys; print('{\\"throughput\\": %s}' % sys.argv[2])"
        >>> run_trial([sys.executable, "-c", script], {"bs": 4}).objective
        4.0
    """
    if not command:
        raise TuneValueError("command must not be empty")
    if timeout <= 0:
        raise TuneValueError(f"timeout must be positive, got timeout={timeout!r}")
    argv = launch_argv(command, cfg)
    procs = layout_processes(cfg, command)
    grace = 0.0 if procs is None else _LAUNCHER_GRACE_S
    stop_signal = signal.SIGKILL if procs is None else signal.SIGTERM
    extra: dict[str, Any] = {} if procs is None else {"processes": procs}
    start = time.monotonic()
    proc: subprocess.Popen[str] | None = None
    guard = None
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: killed as one, with its children
            preexec_fn=(
                functools.partial(_die_with_parent, os.getpid(), stop_signal) if _PRCTL else None
            ),
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
        guard = _start_guard(proc.pid, grace)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = _stop(proc, grace)
            return TrialResult(
                status="timeout",
                returncode=proc.returncode,
                elapsed_s=time.monotonic() - start,
                error=f"timed out after {timeout:g} s",
                output_tail=(out + err)[-_TAIL_CHARS:],
                extra=extra,
            )
    except BaseException:  # Ctrl-C, SIGTERM: stop the trial too, record nothing, let caller decide
        if proc is not None:
            _stop(proc, grace)
        raise
    finally:
        _release_guard(guard)
    assert proc is not None
    elapsed = time.monotonic() - start
    tail = (out + err)[-_TAIL_CHARS:]
    rc = proc.returncode
    result = last_json_line(out) if rc == 0 else None
    val = result.get(objective) if result is not None else None
    if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val):
        return TrialResult(
            "ok", result=result, objective=float(val), returncode=rc, elapsed_s=elapsed,
            extra=extra,
        )  # fmt: skip
    # SIGKILL without a message is what the Linux OOM killer leaves behind.
    if _OOM_PATTERN.search(out) or _OOM_PATTERN.search(err) or rc == -signal.SIGKILL:
        status, error = "oom", "out of memory"
    elif rc != 0:
        status, error = "failed", f"exited with code {rc}"
        reason = failure_reason(err)
        if reason:
            error += f": {reason}"
    elif result is None:
        status, error = "failed", "printed no JSON result line"
    else:
        status, error = "failed", f"result has no finite number under {objective!r}"
    return TrialResult(
        status, result=result, returncode=rc, elapsed_s=elapsed, error=error, output_tail=tail,
        extra=extra,
    )  # fmt: skip
