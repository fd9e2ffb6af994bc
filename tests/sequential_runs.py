"""Several ``slapo train`` runs one after another in the processes of one torchrun launch.

``python -m torch.distributed.run --nproc-per-node N sequential_runs.py PLAN`` where PLAN is a
JSON file: a list of ``{"name": ..., "argv": [...], "out": ...}``, ``argv`` the arguments after
``slapo train`` (``--output-dir out`` included). Starting N processes (each importing torch and
transformers, then warming up what a first run loads lazily) costs more than a short run on a
few cores, so the tests share a launch per world size (tests/shared_launches.py).

Each run is the ``slapo train`` command's own code (:func:`slapo.cli.main`), on a process group
of its own: rank 0 picks a free port for the run and publishes it in torchrun's store, and the
run's rendezvous uses a fresh TCP store there, so no run reads keys an earlier run left behind.
Per run, each rank's stdout goes to ``<out>.rank<r>.stdout``; rank 0 writes ``<out>.done`` once
every rank finished it. A failing run ends the launch (this rank exits non-zero and torchrun
stops the others): the runs after it are not attempted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from dist_utils import free_port  # held until this process exits: no one else can take it


def _run_port(agent_store, index: int, rank: int) -> int:
    """The port of run ``index``'s own store: chosen by rank 0 just before the run starts."""
    key = f"sequential_runs/{index}/port"
    if rank == 0:
        agent_store.set(key, str(free_port()))
    return int(agent_store.get(key).decode())


def main(plan_file: str) -> int:
    import torch.distributed as dist

    from slapo.cli import main as slapo_main

    plan = json.loads(Path(plan_file).read_text())
    rank = int(os.environ["RANK"])
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    for index, run in enumerate(plan):
        os.environ["MASTER_PORT"] = str(_run_port(agent_store, index, rank))
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # the run's own store, not torchrun's
        out = Path(run["out"])
        stdout = out.with_name(f"{out.name}.rank{rank}.stdout")
        try:
            with open(stdout, "w") as f, contextlib.redirect_stdout(f):
                code = slapo_main(["train", *run["argv"]])
        except BaseException:  # noqa: BLE001  (SystemExit included: reported, then the launch ends)
            traceback.print_exc()
            code = 1
        if code != 0:
            print(f"sequential_runs: run {run['name']!r} failed on rank {rank}", file=sys.stderr)
            return code
        if rank == 0:  # after the run's closing barrier: every rank finished it
            out.with_name(f"{out.name}.done").touch()
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1])
    # as `python -m slapo` does under torchrun: leave without the interpreter's finalization
    # (a gloo thread still releasing tensors can abort it), every file already closed
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
