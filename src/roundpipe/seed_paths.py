"""The module paths seed 004 documents (``roundpipe.batch``, ``roundpipe.device``, ...), kept
importable now that the code lives in sub-packages.

Each path names the same module object as its new home, so ``import roundpipe.batch``,
``from roundpipe.device import wait_devices_idle`` and a test's ``monkeypatch.setattr`` on either
name all act on one module.

Example:
    >>> import roundpipe.batch, roundpipe.runtime.batch
    >>> roundpipe.batch is roundpipe.runtime.batch
    True
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["SEED_PATHS", "register_seed_paths"]

#: seed 004's module name -> where it lives now (``roundpipe.optim`` and ``roundpipe.models``
#: are packages of their own and need no entry).
SEED_PATHS: dict[str, str] = {
    "attribute": "devices.attribute",
    "roundpipe": "wrapping.model",
    "wrapper": "wrapping.wrap",
    "utils": "wrapping.sizes",
    "batch": "runtime.batch",
    "context": "runtime.context",
    "profile": "runtime.profile",
    "run": "runtime.run",
    "run_config": "runtime.run_config",
    "scheduler": "runtime.plan",
    "timer": "runtime.timer",
    "device": "devices.device",
    "memory": "devices.pinning",
    "threads": "devices.threads",
    "transfer": "devices.transfer",
    "optim_builder": "optim.builder",
    "optim_stream": "optim.stream",
    "grad_scaler": "optim.grad_scaler",
}


def register_seed_paths(package: ModuleType) -> None:
    """Make ``<package>.<seed name>`` import as the module it moved to: an entry in
    ``sys.modules`` (what ``import`` looks up) and an attribute of the package (what
    ``package.name`` reads)."""
    for old, new in SEED_PATHS.items():
        module = importlib.import_module(f"{package.__name__}.{new}")
        sys.modules.setdefault(f"{package.__name__}.{old}", module)
        setattr(package, old, module)
