"""Build, load and cache the C++ implementation of optimizer functions.

Each optimizer function ``name`` lives in ``roundpipe/optim/csrc/<name>.cpp`` and is exported from that
file's extension module under the same name. On first use the source is compiled with
:func:`torch.utils.cpp_extension.load` (ninja, ``-O3 -march=native -fopenmp``) into a cache
directory keyed by a hash of the source, the CPU flags, the compiler flags and the torch and Python
versions, so a changed source or a different machine never picks up a stale binary. A file lock
serializes concurrent builds of the same extension (several processes of one job starting at
once); later processes import the cached module directly without invoking the compiler.

Environment variables:

- ``ROUNDPIPE_EXTENSION_DIR``: cache directory (default ``~/.cache/roundpipe/extensions``).
- ``ROUNDPIPE_DISABLE_CPP_OPTIM=1``: never build; :func:`get_optim_function` raises
  :class:`OptimBuildError` and :class:`roundpipe.optim.Adam` uses its PyTorch fallback.

Example:
    >>> from roundpipe.optim_builder import get_optim_function
    >>> adam = get_optim_function("adam")  # compiles once, then cached  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..errors import RoundPipeError, RoundPipeValueError

__all__ = [
    "OptimBuildError",
    "extension_dir",
    "get_cpu_flags_hash",
    "get_optim_function",
    "load_optim_function",
    "loaded_optim_functions",
]

#: Loaded optimizer functions by name (a process-wide cache).
loaded_optim_functions: dict[str, Callable] = {}

# Names whose build failed in this process: failing again on every step would be slow and noisy.
_failed: dict[str, str] = {}
_lock = threading.Lock()

_CSRC = Path(__file__).resolve().parent / "csrc"
# -fno-math-errno lets gcc vectorize sqrt. -ffp-contract=off: the kernel places its fused
# multiply-adds explicitly where torch's vectorized CPU kernels have them, and nowhere else, so
# results track torch.optim.Adam to the last bit almost everywhere.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]


class OptimBuildError(RoundPipeError, RuntimeError):
    """The C++ optimizer function could not be built or loaded (no compiler, disabled, ...)."""


def extension_dir() -> Path:
    """Return the cache directory for compiled optimizer extensions.

    Returns:
        ``$ROUNDPIPE_EXTENSION_DIR`` if set, else ``~/.cache/roundpipe/extensions``.

    Example:
        >>> extension_dir().name in ("extensions", os.environ.get("ROUNDPIPE_EXTENSION_DIR", ""))
        True
    """
    env = os.environ.get("ROUNDPIPE_EXTENSION_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "roundpipe" / "extensions"


def get_cpu_flags_hash() -> str:
    """Get a hash string representing the CPU flags.

    The binary is compiled with ``-march=native``, so it must not be reused on a CPU with other
    instruction set extensions (a shared home directory across a heterogeneous cluster).

    Returns:
        A short hex digest of the CPU model flags.

    Example:
        >>> len(get_cpu_flags_hash())
        16
    """
    text = f"{platform.machine()} {platform.processor()}"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            # x86 calls them "flags", arm64 "Features"; the first core is representative.
            if line.startswith(("flags", "Features")):
                text += line
                break
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_enabled() -> None:
    if os.environ.get("ROUNDPIPE_DISABLE_CPP_OPTIM", "0") not in ("", "0"):
        raise OptimBuildError("C++ optimizers disabled by ROUNDPIPE_DISABLE_CPP_OPTIM=1")


def _source_files(name: str) -> list[Path]:
    source = _CSRC / f"{name}.cpp"
    if not source.is_file():
        raise RoundPipeValueError(f"unknown optimizer function {name!r}: no source {source}")
    return [source]


def _build_hash(name: str) -> str:
    h = hashlib.sha256()
    for path in sorted(_CSRC.glob("*.h")) + _source_files(name):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    key = [get_cpu_flags_hash(), torch.__version__, sys.version, *_CFLAGS, *_LDFLAGS]
    h.update("\0".join(key).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block.

    ``flock`` is released by the kernel when a holder dies, so a crashed build never leaves a
    stale lock behind (unlike a lock file whose existence is the lock).
    """
    try:
        import fcntl  # deferred: POSIX only; the fallback below covers other systems
    except ImportError:  # not POSIX: torch's own baton, which polls for a lock file
        from torch.utils.file_baton import FileBaton  # deferred: only without fcntl

        baton = FileBaton(str(path) + ".baton")
        if baton.try_acquire():
            try:
                yield
            finally:
                baton.release()
        else:
            baton.wait()
            yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _import_module(module_name: str, path: Path) -> object:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise OptimBuildError(f"cannot import extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_optim_function(name: str) -> Callable:
    """Compile and load the optimizer function from source by name.

    Builds ``csrc/<name>.cpp`` unless a binary for the same source and CPU is already cached,
    then imports it. Safe to call from several processes at once: the first builds, the others
    wait on a file lock and import its result.

    Args:
        name: The name of the optimizer function (also the name of its source file).

    Returns:
        The optimizer function.

    Raises:
        ValueError: If there is no source for ``name``.
        OptimBuildError: If building is disabled or the compiler fails.

    Example:
        >>> fn = load_optim_function("adam")  # doctest: +SKIP
    """
    _check_enabled()
    sources = _source_files(name)
    module_name = f"roundpipe_{name}_{_build_hash(name)}"
    build_dir = extension_dir() / module_name
    library = build_dir / f"{module_name}.so"
    try:
        if not library.is_file():
            build_dir.mkdir(parents=True, exist_ok=True)
            with _file_lock(build_dir.with_name(module_name + ".lock")):
                # Another process may have finished the build while we waited for the lock.
                if not library.is_file():
                    return getattr(_compile(module_name, sources, build_dir), name)
        module = _import_module(module_name, library)
    except OptimBuildError:
        raise
    except Exception as exc:  # compiler missing or failing, ninja missing, bad binary, ...
        raise OptimBuildError(f"building the C++ optimizer {name!r} failed: {exc}") from exc
    return getattr(module, name)


def _compile(module_name: str, sources: list[Path], build_dir: Path) -> object:
    from torch.utils import cpp_extension  # deferred: heavy, needed only to compile

    # ninja writes the .so under its final name only once linking succeeded.
    return cpp_extension.load(
        name=module_name,
        sources=[str(s) for s in sources],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        verbose=os.environ.get("ROUNDPIPE_VERBOSE_BUILD", "0") not in ("", "0"),
    )


def get_optim_function(name: str) -> Callable:
    """Get the optimizer function by name, building it on first use.

    Args:
        name: The name of the optimizer function.

    Returns:
        The optimizer function.

    Raises:
        OptimBuildError: If it cannot be built; the failure is remembered for this process.

    Example:
        >>> adam = get_optim_function("adam")  # doctest: +SKIP
        >>> adam is get_optim_function("adam")  # doctest: +SKIP
        True
    """
    _check_enabled()
    fn = loaded_optim_functions.get(name)
    if fn is not None:
        return fn
    with _lock:  # threads of one process build once
        if name in loaded_optim_functions:
            return loaded_optim_functions[name]
        if name in _failed:
            raise OptimBuildError(_failed[name])
        try:
            fn = load_optim_function(name)
        except OptimBuildError as exc:
            _failed[name] = str(exc)
            raise
        loaded_optim_functions[name] = fn
        return fn
