"""The tuning loop: ask a strategy, run a trial, commit the record, repeat."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from .database import Database
from .errors import TuneError, TuneTypeError, TuneValueError
from .launch import check_launchable, layout_processes
from .memory_budget import SKIPPED, Estimator, required_bytes
from .space import Space, Value, config_key
from .strategies import STRATEGIES, make_strategy
from .trial import run_trial

DIRECTIONS = ("maximize", "minimize")
logger = logging.getLogger("slapo.tune")


class TuneInterrupted(KeyboardInterrupt):
    """The tuner received SIGTERM or SIGHUP; handled like Ctrl-C (a ``KeyboardInterrupt``).

    ``signum`` is the signal; the running trial is stopped and the database saved first.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _termination_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`TuneInterrupted` in the main thread, once.

    Their default action ends the process on the spot, with no chance to stop the trial or
    save the database. Only signals left at their default are taken over (``nohup`` keeps
    SIGHUP ignored); after the first one, repeats are ignored so the (bounded) cleanup
    finishes. SIGINT already raises KeyboardInterrupt.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    fired = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise TuneInterrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Tuner:
    """Measure the configurations of ``space`` with ``command``, recording them in ``db``.

    Configurations already in the database are never run again, whatever their outcome, so
    a run that crashed resumes where it stopped. ``budget`` caps the number of measured
    configurations of this space, counting those of earlier runs.

    With ``memory_budget`` (bytes), ``estimate(cfg)`` (bytes, a ``MemoryEstimate`` or None)
    screens every configuration still to measure before the first trial: those that need more
    are recorded as ``"skipped"`` with the reason and never run (see :mod:`slapo.tune.memory_budget`).

    A configuration with layout symbols (``tp``, ``pp``, ``cp``, ``dp``) runs on
    ``dp * pp * cp * tp`` processes under torchrun (:mod:`slapo.tune.launch`); with ``max_procs``, those needing more
    are skipped the same way, before any trial (and before any estimate).

    Example:
        >>> import sys
        >>> space = Space()
        >>> _ = space.create_symbol("bs", [1, 2, 3])
        >>> script = "import sys; print('{\\"throughput\\": %s}' % sys.argv[2])"
        >>> tuner = Tuner(space, [sys.executable, "-c", script], Database(), progress=False)
        >>> len(tuner.run())
        3
        >>> tuner.best(1)[0]["config"]
        {'bs': 3}
    """

    def __init__(
        self,
        space: Space | Sequence[Mapping[str, Value]],
        command: Sequence[str],
        db: Database,
        *,
        strategy: str = "exhaustive",
        budget: int | None = None,
        objective: str = "throughput",
        direction: str = "maximize",
        timeout: float = 600.0,
        seed: int = 0,
        progress: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        memory_budget: int | None = None,
        estimate: Estimator | None = None,
        max_procs: int | None = None,
    ) -> None:
        if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
            raise TuneTypeError(
                f"command must be a non-empty list of strings, got command={command!r}"
            )
        if strategy not in STRATEGIES:
            raise TuneValueError(
                f"unknown strategy={strategy!r}; choose one of {sorted(STRATEGIES)}"
            )
        if direction not in DIRECTIONS:
            raise TuneValueError(
                f"direction must be one of {DIRECTIONS}, got direction={direction!r}"
            )
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise TuneValueError(f"budget must be a positive int or None, got budget={budget!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise TuneValueError(
                f"timeout must be a positive number of seconds, got timeout={timeout!r}"
            )
        if not isinstance(db, Database):
            raise TuneTypeError(f"db must be a slapo.tune.Database, got db={db!r}")
        if memory_budget is not None and (
            isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
            or memory_budget < 1
        ):  # fmt: skip
            raise TuneValueError(
                f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}"
            )
        if memory_budget is not None and not callable(estimate):
            raise TuneError(
                "memory_budget needs estimate=cfg -> bytes: for a slapo train command, "
                "slapo.train.train_cli.train_estimator(command); otherwise define "
                "estimate_memory(args, cfg) in the --config file"
            )
        if max_procs is not None and (
            isinstance(max_procs, bool) or not isinstance(max_procs, int) or max_procs < 1
        ):
            raise TuneValueError(f"max_procs must be a positive int or None, got {max_procs!r}")
        self.configs = list(space)
        if not self.configs:
            raise TuneError("the tuning space has no valid configuration")
        try:  # a bad layout value or a command that launches itself: an error before any trial
            self.procs = [layout_processes(c, command) for c in self.configs]
            if any(n is not None for n in self.procs):
                check_launchable(command)
        except ValueError as exc:
            raise TuneError(str(exc)) from exc
        self.keys = [config_key(c) for c in self.configs]
        self.command = list(command)
        self.db = db
        self.strategy_name = strategy
        self.budget = budget
        self.objective = objective
        self.direction = direction
        self.timeout = float(timeout)
        self.seed = seed
        self.progress = progress
        self.env = env
        self.cwd = cwd
        self.memory_budget = memory_budget
        self.estimate = estimate
        self.max_procs = max_procs

    # ----- reading results ----------------------------------------------------------------
    def value(self, record: Mapping[str, Any]) -> float | None:
        """The objective of a record, or None if the trial failed or lacks it."""
        if record.get("status") != "ok":
            return None
        val = (record.get("result") or {}).get(self.objective)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            return None
        return float(val)

    def records(self) -> list[dict[str, Any]]:
        """Records of this space's measured configurations, in the order measured (those the
        memory budget skipped are in :meth:`skipped`)."""
        recs = [self.db[k] for k in self.keys if k in self.db and not _is_skipped(self.db[k])]
        return sorted(recs, key=lambda r: r.get("trial", 0))

    def skipped(self) -> list[dict[str, Any]]:
        """Records of this space's configurations the memory budget or ``max_procs`` dropped,
        never run."""
        return [self.db[k] for k in self.keys if k in self.db and _is_skipped(self.db[k])]

    def best(self, k: int = 5) -> list[dict[str, Any]]:
        """The ``k`` best successful records, best first."""
        ok = [r for r in self.records() if self.value(r) is not None]
        ok.sort(key=lambda r: self.value(r), reverse=self.direction == "maximize")  # type: ignore[arg-type, return-value]
        return ok[:k]

    def _scores(self) -> dict[int, float | None]:
        """Index -> score where higher is better (strategies always maximize)."""
        sign = 1.0 if self.direction == "maximize" else -1.0
        scores: dict[int, float | None] = {}
        for i, key in enumerate(self.keys):
            if key in self.db and not _is_skipped(self.db[key]):
                val = self.value(self.db[key])
                scores[i] = None if val is None else sign * val
        return scores

    # ----- running --------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Run trials until the budget is spent or every configuration is measured.

        Returns this space's records (earlier runs included), in the order measured. Ctrl-C,
        SIGTERM or SIGHUP kill the running trial's whole process group, save the database
        (the interrupted trial is not recorded, so a re-run measures it) and raise
        ``KeyboardInterrupt`` (:class:`TuneInterrupted` for the signals). A trial never
        outlives the tuner, even one killed with SIGKILL (see :func:`run_trial`).
        """
        with _termination_as_interrupt():
            try:
                return self._run()
            except KeyboardInterrupt:
                self.db.save()  # the file exists and parses even if no trial finished
                raise

    def _note(self, line: str) -> None:
        if self.progress:
            tqdm.write(line, file=sys.stderr)
        else:
            logger.info(line)

    def _skip(self, i: int, reason: str, details: Mapping[str, Any]) -> None:
        """Record configuration ``i`` as skipped (never run) for ``reason``."""
        cfg = self.configs[i]
        record = {"config": cfg, "status": SKIPPED, "error": reason, "trial": 0, **details}
        self.db.commit(self.keys[i], {**record, "command": self.command, "time": time.time()})
        self._note(f"[skipped] {Space.cfg_dict_to_str(cfg)}: {reason}")

    def _screen(self) -> set[int]:
        """Check every configuration still to measure (a skipped one again: the limits may have
        grown): record those whose layout needs more than ``max_procs`` processes, then those
        estimated over the memory budget. Returns their indices."""
        pending = [
            i for i, k in enumerate(self.keys) if k not in self.db or _is_skipped(self.db[k])
        ]
        over: set[int] = set()
        if self.max_procs is not None:
            for i in pending:
                procs = self.procs[i]
                if procs is not None and procs > self.max_procs:
                    reason = f"needs {procs} processes (dp * pp * cp * tp), over --max-procs "
                    reason += str(self.max_procs)
                    self._skip(i, reason, {"processes": procs, "max_procs": self.max_procs})
                    over.add(i)
        if self.memory_budget is not None:
            over |= self._screen_memory([i for i in pending if i not in over])
        return over

    def _screen_memory(self, pending: list[int]) -> set[int]:
        """Estimate the configurations ``pending``; record those over the memory budget."""
        budget = self.memory_budget
        assert budget is not None and self.estimate is not None
        from ..memory import format_bytes  # deferred: fake tensors load on first use

        if pending:
            self._note(
                f"[memory] estimating {len(pending)} configurations against the budget of "
                f"{format_bytes(budget)}"
            )
        over: set[int] = set()
        for i in pending:
            cfg = self.configs[i]
            try:
                estimate = self.estimate(cfg)
                need = required_bytes(estimate)
            except Exception as exc:  # noqa: BLE001  (no estimate: the trial decides)
                self._note(
                    f"[memory] {Space.cfg_dict_to_str(cfg)}: no estimate ({type(exc).__name__}: "
                    f"{exc}); it runs"
                )
                continue
            if need is None or need <= budget:
                continue
            over.add(i)
            reason = (
                f"estimated peak {format_bytes(need)} exceeds the memory budget "
                f"{format_bytes(budget)}"
            )
            details = estimate.as_dict() if hasattr(estimate, "as_dict") else {"required": need}
            self._skip(i, reason, {"estimate": details, "memory_budget": budget})
        return over

    def _run(self) -> list[dict[str, Any]]:
        screened = self.memory_budget is not None or self.max_procs is not None
        over = self._screen() if screened else set()
        scores = self._scores()
        measured = len(scores)
        scores.update({i: None for i in over})  # never proposed; a model-guided search learns
        runnable = len(self.configs) - len(over)
        limit = runnable if self.budget is None else min(self.budget, runnable)
        todo = max(0, limit - measured)
        strategy = make_strategy(self.strategy_name, self.configs, seed=self.seed)
        next_trial = 1 + max(
            (int(r.get("trial", 0)) for r in self.db.db.values() if isinstance(r, dict)), default=0
        )
        bar = tqdm(
            total=todo, desc="tune", unit="trial", disable=not self.progress, dynamic_ncols=True
        )
        try:
            for _ in range(todo):
                idx = strategy.propose(scores)
                if idx is None:
                    break
                cfg = self.configs[idx]
                res = run_trial(
                    self.command,
                    cfg,
                    objective=self.objective,
                    timeout=self.timeout,
                    env=self.env,
                    cwd=self.cwd,
                )
                record = {
                    "config": cfg,
                    "trial": next_trial,
                    "strategy": self.strategy_name,
                    "objective_key": self.objective,
                    "command": self.command,
                    "time": time.time(),
                    **res.to_record(),
                }
                self.db.commit(self.keys[idx], record)
                next_trial += 1
                val = self.value(record)
                sign = 1.0 if self.direction == "maximize" else -1.0
                scores[idx] = None if val is None else sign * val
                outcome = (
                    f"{self.objective}={val:g}"
                    if val is not None
                    else (f"{res.status}: {res.error}")
                )
                line = (
                    f"[trial {record['trial']}] {Space.cfg_dict_to_str(cfg)} -> {outcome} "
                    f"({res.elapsed_s:.1f} s)"
                )
                if self.progress:
                    bar.write(line, file=sys.stderr)
                else:
                    logger.info(line)
                best = self.best(1)
                if best:
                    bar.set_postfix_str(f"best {self.objective}={self.value(best[0]):g}")
                bar.update(1)
        finally:
            bar.close()
        return self.records()


def _is_skipped(record: Any) -> bool:
    return isinstance(record, Mapping) and record.get("status") == SKIPPED


def default_plot_path(db_file_name: str) -> str:
    """``results.json`` -> ``results.png``, next to the database."""
    return os.path.splitext(db_file_name)[0] + ".png"
