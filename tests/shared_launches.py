"""Several ``slapo train`` runs of the suite sharing one torchrun launch per world size.

Starting 2, 4 or 8 processes (each importing torch and transformers) costs more than the short
runs the tests make, so a test module plans its runs when imported (:func:`plan_run`) and asks
the session's :class:`Launches` (the ``launches`` fixture, tests/conftest.py) for their results:
the first request for a world size launches every run planned for it, one after another in the
same processes (tests/sequential_runs.py), each on a process group of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dist_utils import free_port

HERE = Path(__file__).resolve().parent

#: The runs sharing launches: world size -> run name -> the run's ``slapo train`` arguments
#: given its launch's directory. Test modules plan their runs when imported (:func:`plan_run`),
#: so a session launches every collected run of a world size.
PLANNED: dict[int, dict[str, Callable[[Path], list[str]]]] = {}


def plan_run(nproc: int, name: str, args: Callable[[Path], list[str]]) -> str:
    """Plan the run ``name`` on ``nproc`` processes (in the order planned); returns ``name``.

    ``args(root)`` gives its arguments, ``root`` being its launch's directory, where the run's
    output directory is ``root / name`` and paths it shares with another run may go.
    """
    if name in PLANNED.setdefault(nproc, {}):
        raise ValueError(f"a {nproc}-process run {name!r} is planned twice")
    PLANNED[nproc][name] = args
    return name


class Launches:
    """One torchrun launch per world size running every run planned for it
    (:data:`PLANNED`), started by the first :meth:`result` asked of that size."""

    def __init__(self, root: Path) -> None:
        self.root, self._launched = root, {}

    def dir(self, nproc: int) -> Path:
        """The directory of the ``nproc``-process launch (its runs' output directories)."""
        return self.root / f"nproc{nproc}"

    def result(self, nproc: int, name: str) -> tuple[list[float], dict[str, Any]]:
        """Run ``name``'s losses and metrics (:meth:`Launch.result`)."""
        if nproc not in self._launched:
            root = self.dir(nproc)
            root.mkdir(parents=True, exist_ok=True)
            runs = {n: (args(root), root / n) for n, args in PLANNED[nproc].items()}
            self._launched[nproc] = Launch(nproc, runs, root / "plan.json")
        return self._launched[nproc].result(name)


class Launch:
    """Several ``slapo train`` runs in the processes of one torchrun launch, in order
    (tests/sequential_runs.py): start-up is paid once, not once per run.

    ``runs`` maps a run's name to its arguments (after ``slapo train``) and output directory. A run
    that fails ends the launch; :meth:`result` of it, or of a run after it, fails naming it.
    """

    def __init__(self, nproc: int, runs: dict[str, tuple[list[str], Path]], plan: Path) -> None:
        self.nproc, self.outs = nproc, {name: out for name, (_, out) in runs.items()}
        steps = [{"name": name, "argv": [*args, "--output-dir", str(out)], "out": str(out)}
                 for name, (args, out) in runs.items()]  # fmt: skip
        plan.write_text(json.dumps(steps))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(HERE / "sequential_runs.py"), str(plan)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, self.stderr = proc.communicate(timeout=540)
        self.returncode = proc.returncode

    def result(self, name: str) -> tuple[list[float], dict[str, Any]]:
        """Run ``name``'s losses and metrics.json (with every rank's ``stdout``, in rank order);
        it must have succeeded."""
        out = self.outs[name]
        failed = [line for line in self.stderr.splitlines() if line.startswith("sequential_runs:")]
        assert out.with_name(f"{out.name}.done").exists(), (
            f"run {name!r} of the {self.nproc}-process launch did not finish (launch exit code "
            f"{self.returncode}; runs in order: {list(self.outs)}; {failed or 'no run failed'})"
            f":\n{self.stderr[-4000:]}"
        )
        metrics = json.loads((out / "metrics.json").read_text())
        ranks = [out.with_name(f"{out.name}.rank{r}.stdout") for r in range(self.nproc)]
        return metrics["losses"], {"stdout": "".join(f.read_text() for f in ranks), **metrics}
