"""Spawn gloo workers on 127.0.0.1 with a hard deadline; collect each rank's result or traceback."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# sockets holding the ports free_port() handed out, for the life of this process
_RESERVED: list[socket.socket] = []


def free_port() -> int:
    """A port no other process can take until a server of the caller's binds it.

    A port found free and released at once can be taken by any process (a concurrent run's
    gloo or store) before the launched rendezvous store binds it. So the port stays bound here,
    with ``SO_REUSEADDR`` and never listening, for the life of this process: other binds to it
    fail and ``bind(0)`` skips it, while the store (c10d's, which also sets ``SO_REUSEADDR``)
    binds and listens on it beside this socket.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out: str, timeout: float, args: tuple):
    import torch

    import slapo.env

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        slapo.env.setup(rank, world, "gloo", master_port=port, timeout=timeout)
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException:  # noqa: BLE001  (reported to the parent)
        result = {"ok": False, "error": traceback.format_exc()}
    with open(out, "wb") as f:
        pickle.dump(result, f)
    try:
        slapo.env.teardown()
    except Exception:  # noqa: BLE001  (a group already torn down by a failing pipeline)
        pass


def run_workers(
    fn: Callable, world: int, args: tuple = (), timeout: float = 60.0, deadline: float = 180.0
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; never waits past ``deadline``.

    Returns per rank ``{"ok": True, "value": ...}``, ``{"ok": False, "error": traceback}``, or
    ``{"ok": False, "error": "exit code N"}`` for a rank that died without reporting.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="slapo-dist-")
    outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, outs[r], timeout, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    results = []
    for p, out in zip(procs, outs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"ok": False, "error": f"still running after {deadline}s: killed"})
        elif os.path.exists(out):
            with open(out, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append({"ok": False, "error": f"exit code {p.exitcode}"})
    return results


def check_all(results: list[dict[str, Any]]) -> list[Any]:
    """Raise with every failing rank's traceback; return each rank's value."""
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res["value"] for res in results]


def run_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    """Run named checks in order; a failure is recorded (traceback) and the next check runs."""
    report: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check()
            report[name] = None
        except Exception:  # noqa: BLE001  (reported per check)
            report[name] = traceback.format_exc()
    return report


def assert_check(reports: list[dict[str, str | None]], name: str) -> None:
    """Fail with every rank's traceback for the named check of :func:`run_checks`."""
    errors = [f"rank {r}:\n{rep[name]}" for r, rep in enumerate(reports) if rep[name]]
    assert not errors, "\n".join(errors)
