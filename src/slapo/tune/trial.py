"""Run one configuration of a training command in a subprocess and read its result."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .space import Value

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


def config_to_flags(cfg: Mapping[str, Value]) -> list[str]:
    """Turn a configuration into ``--name value`` flags (underscores become dashes).

    Example:
        >>> config_to_flags({"batch_size": 8, "ckpt_ratio": 0.5})
        ['--batch-size', '8', '--ckpt-ratio', '0.5']
    """
    flags: list[str] = []
    for name, val in cfg.items():
        flags += [f"--{name.replace('_', '-')}", str(val)]
    return flags


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


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the trial and everything it spawned (it runs in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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

    The result is the last JSON object line the command prints to stdout; it must hold a
    finite number under ``objective``. Non-zero exit, an out-of-memory message, a timeout
    or a missing result are failures with a status and a tail of the output.

    Example:
        >>> import sys
        >>> script = "import sys; print('{\\"throughput\\": %s}' % sys.argv[2])"
        >>> run_trial([sys.executable, "-c", script], {"bs": 4}).objective
        4.0
    """
    if not command:
        raise ValueError("command must not be empty")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got timeout={timeout!r}")
    argv = [*command, *config_to_flags(cfg)]
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,  # so a timeout can kill the whole process group
        env=dict(env) if env is not None else None,
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return TrialResult(
            status="timeout",
            returncode=proc.returncode,
            elapsed_s=time.monotonic() - start,
            error=f"timed out after {timeout:g} s",
            output_tail=(out + err)[-_TAIL_CHARS:],
        )
    except BaseException:  # Ctrl-C: stop the trial too, record nothing, let the caller decide
        _kill_group(proc)
        proc.communicate()
        raise
    elapsed = time.monotonic() - start
    tail = (out + err)[-_TAIL_CHARS:]
    rc = proc.returncode
    result = last_json_line(out) if rc == 0 else None
    val = result.get(objective) if result is not None else None
    if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val):
        return TrialResult(
            "ok", result=result, objective=float(val), returncode=rc, elapsed_s=elapsed
        )
    # SIGKILL without a message is what the Linux OOM killer leaves behind.
    if _OOM_PATTERN.search(out) or _OOM_PATTERN.search(err) or rc == -signal.SIGKILL:
        status, error = "oom", "out of memory"
    elif rc != 0:
        status, error = "failed", f"exited with code {rc}"
    elif result is None:
        status, error = "failed", "printed no JSON result line"
    else:
        status, error = "failed", f"result has no finite number under {objective!r}"
    return TrialResult(
        status, result=result, returncode=rc, elapsed_s=elapsed, error=error, output_tail=tail
    )
