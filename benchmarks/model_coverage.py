"""Which transformers causal-LM architectures Slapo schedules without changing the numbers (CPU).

    python benchmarks/model_coverage.py [--types llama,gpt2,...] [--skip-tp]
        [--out docs/model_coverage.md] [--json docs/model_coverage.json] [--timeout-per-model 300]
    python benchmarks/model_coverage.py --readme-totals docs/model_coverage.json

Every ``model_type`` of transformers' causal-LM mapping (or those ``--types`` names) becomes a
tiny random model (:func:`slapo.testing.zoo_models.tiny_model`: 2 layers, hidden 64, dropout off) and
goes through four checks of :mod:`slapo.testing.zoo_checks`, each comparing the loss and every gradient
of one training step with the unscheduled model's:

* eager: the model trains, and two runs agree (else nothing can be compared with it);
* schedule: ``apply_schedule(model)`` with no knobs (the recommended schedule);
* trace: the first block traced with no example inputs, at two input shapes;
* TP=2: ``apply_schedule(model, group=..., ckpt_ratio=0.0)`` over 2 gloo ranks, each rank's
  shard of every gradient against one process.

The single-process checks run in a spawned worker process that goes through the types in order
and is restarted from the next type when one takes more than ``--timeout-per-model`` seconds or
kills the process. TP runs as one 2-rank gloo job looping over the types (spawned once); a type
that fails on one rank only, hangs, or leaves the ranks out of step (checked by an all-reduce of
the type's index after each) ends the job, which restarts from the next type. Progress goes to
stderr; the table to ``--out`` (markdown) and the results to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from slapo import testing as zoo
from slapo.testing import CheckResult

#: The single-process checks, in the order they run and appear in the table.
SINGLE_CHECKS: dict[str, Callable[[str], CheckResult]] = {
    "eager": zoo.check_eager,
    "schedule": zoo.check_schedule,
    "trace": zoo.check_trace,
}
COLUMNS = ("eager", "schedule", "trace", "tp")
TITLES = {"eager": "eager", "schedule": "schedule", "trace": "trace", "tp": "TP=2"}
#: Seconds a fresh worker may take to start (imports) on top of its first type's timeout.
STARTUP_S = 90.0
WORLD = 2
#: A TP job's exit status when its ranks fell out of step after a type (the next type is then
#: run by a fresh job, not blamed).
OUT_OF_STEP_CODE = 3
OUT_OF_STEP = "ranks out of step"
#: The suffix of the file of the checks done so far of the type in progress.
PARTIAL = ".partial"
#: How ``check_tp`` ends the detail of a plan that sharded no parameter.
UNSHARDED = "nothing sharded"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _append(path: str, doc: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc) + "\n")
        f.flush()


def _read_lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


# --- workers (run in spawned processes) ----------------------------------------------------------


def single_worker(types: list[str], out: str) -> None:
    """Each type's single-process checks, one JSON line per type appended to ``out``; the
    checks of the type in progress so far in ``out`` + ``.partial`` (for a type that hangs)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for model_type in types:
        doc: dict[str, Any] = {"type": model_type, "seconds": {}}
        for name, check in SINGLE_CHECKS.items():
            _write_partial(out, doc, name)
            start = time.perf_counter()
            if name != "eager" and doc["eager"]["status"] not in ("equal", "different"):
                result = CheckResult("n/a", "does not train unscheduled")
            else:
                result = check(model_type)
            doc["seconds"][name] = round(time.perf_counter() - start, 2)
            doc[name] = result.as_dict()
        _append(out, doc)


def _write_partial(out: str, doc: dict[str, Any], running: str) -> None:
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump({**doc, "running": running}, f)
    os.replace(out + ".tmp", out + PARTIAL)


def tp_worker(rank: int, types: list[str], out_dir: str, port: int, timeout: float) -> None:
    """``check_tp`` of every type on this rank, one JSON line per type appended to
    ``out_dir/rank{rank}.jsonl``; exits with status 3 when the ranks fall out of step."""
    import torch.distributed as dist

    import slapo.env

    torch.set_num_threads(1)
    slapo.env.setup(rank, WORLD, "gloo", master_port=port, timeout=timeout)
    out = os.path.join(out_dir, f"rank{rank}.jsonl")
    for index, model_type in enumerate(types, start=1):
        start = time.perf_counter()
        try:
            result = zoo.check_tp(model_type, dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001  (check_tp catches its own; belt and braces)
            result = CheckResult("error", f"{type(exc).__name__}: {exc}"[:200])
        seconds = round(time.perf_counter() - start, 2)
        _append(out, {"type": model_type, "tp": result.as_dict(), "seconds": seconds})
        try:  # the ranks still in step: the same collective sees the same index
            step = torch.tensor([index])
            dist.all_reduce(step)
            in_step = int(step) == WORLD * index
        except Exception:  # noqa: BLE001  (a timed-out or mismatched collective)
            in_step = False
        if not in_step:  # the group is unusable: a fresh job goes on from the next type
            os._exit(OUT_OF_STEP_CODE)
    slapo.env.teardown()


# --- supervision ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[Any], files: list[str], count: int, timeout: float) -> str | None:
    """Wait until every process ends, or one type takes over ``timeout`` seconds (the
    processes are then killed). Returns why the job stopped early (:data:`OUT_OF_STEP` when
    the ranks left the job between two types), or None."""
    ready, deadline = 0, time.monotonic() + timeout + STARTUP_S
    while True:
        done = min(len(_read_lines(f)) for f in files)
        if done > ready:
            ready, deadline = done, time.monotonic() + timeout
        if not any(p.is_alive() for p in procs):
            codes = sorted({p.exitcode for p in procs})
            if done >= count and codes == [0]:
                return None
            return OUT_OF_STEP if codes == [OUT_OF_STEP_CODE] else f"worker exit code {codes}"
        if time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            return f"no result within {timeout:.0f} s (killed)"
        time.sleep(0.5)


def supervise(
    types: list[str],
    start: Callable[[list[str], str], list[Any]],
    files_of: Callable[[str], list[str]],
    timeout: float,
    on_result: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``start(types, tmpdir)`` (which returns its processes) until every type has a
    result, restarting from the type after one that hangs or kills the job.

    ``on_result`` gets each type's lines, one per file (``{"type": ..., "lines": [...]}``); a
    type that stopped the job gets ``"failure"`` (why) and the lines some files have.
    """
    remaining = list(types)
    while remaining:
        tmp = tempfile.mkdtemp(prefix="slapo-coverage-")
        procs = start(remaining, tmp)
        files = files_of(tmp)
        why = _wait(procs, files, len(remaining), timeout)
        per_file = [_read_lines(f) for f in files]
        finished = min(len(lines) for lines in per_file)
        for i in range(finished):
            on_result({"type": remaining[i], "lines": [lines[i] for lines in per_file]})
        remaining = remaining[finished:]
        blame = why is not None and (why != OUT_OF_STEP or finished == 0)
        if blame and remaining:
            partial = [lines[finished] for lines in per_file if len(lines) > finished]
            on_result({"type": remaining[0], "lines": partial, "failure": why, "dir": tmp})
            remaining = remaining[1:]


def run_single(types: list[str], timeout: float, results: dict[str, dict[str, Any]]) -> None:
    """The single-process checks of ``types`` into ``results``."""
    ctx = mp.get_context("spawn")

    def start(todo: list[str], tmp: str) -> list[Any]:
        proc = ctx.Process(target=single_worker, args=(todo, os.path.join(tmp, "single.jsonl")))
        proc.start()
        return [proc]

    def on_result(doc: dict[str, Any]) -> None:
        entry = results[doc["type"]]
        if "failure" in doc:
            line = _after_failure(doc)
        else:
            line = doc["lines"][0]
        for name in SINGLE_CHECKS:
            entry[name] = line[name]
        entry["seconds"].update(line["seconds"])
        _progress(doc["type"], entry, SINGLE_CHECKS, results)

    supervise(types, start, lambda tmp: [os.path.join(tmp, "single.jsonl")], timeout, on_result)


def _after_failure(doc: dict[str, Any]) -> dict[str, Any]:
    """The results of a type that stopped its worker: the checks it finished, the failure for
    the check that was running, and "not run" errors for the rest."""
    path = os.path.join(doc["dir"], "single.jsonl" + PARTIAL)
    try:
        with open(path, encoding="utf-8") as f:
            partial = json.load(f)
    except (OSError, ValueError):
        partial = {"seconds": {}, "running": "eager"}
    if partial.get("type", doc["type"]) != doc["type"]:
        partial = {"seconds": {}, "running": "eager"}
    running = partial["running"]
    for name in SINGLE_CHECKS:
        if name == running:
            partial[name] = CheckResult("error", doc["failure"]).as_dict()
        elif name not in partial:
            why = f"not run: the {running} check did not finish"
            partial[name] = CheckResult("error", why).as_dict()
    return partial


def run_tp(types: list[str], timeout: float, results: dict[str, dict[str, Any]]) -> None:
    """TP=2 over gloo for the ``types`` that train eagerly, into ``results``."""
    ctx = mp.get_context("spawn")

    def start(todo: list[str], tmp: str) -> list[Any]:
        port = _free_port()
        procs = [
            ctx.Process(target=tp_worker, args=(rank, todo, tmp, port, 0.8 * timeout))
            for rank in range(WORLD)
        ]
        for p in procs:
            p.start()
        return procs

    def files_of(tmp: str) -> list[str]:
        return [os.path.join(tmp, f"rank{rank}.jsonl") for rank in range(WORLD)]

    def on_result(doc: dict[str, Any]) -> None:
        entry = results[doc["type"]]
        ranks = [CheckResult.from_dict(line["tp"]) for line in doc["lines"]]
        if "failure" in doc:
            seen = "".join(f"; a rank said {r.status}: {r.detail}" for r in ranks)
            entry["tp"] = CheckResult("error", doc["failure"] + seen).as_dict()
        else:
            entry["tp"] = zoo.worst(ranks).as_dict()
            entry["seconds"]["tp"] = max(line["seconds"] for line in doc["lines"])
        _progress(doc["type"], entry, ("tp",), results)

    supervise(types, start, files_of, timeout, on_result)


def _progress(model_type: str, entry: dict[str, Any], names: Any, results: dict[str, Any]) -> None:
    seen = sum(all(n in e for n in names) for e in results.values())
    parts = [
        f"{n} {entry[n]['status']} {entry['seconds'].get(n, 0):.1f}s" for n in names if n in entry
    ]
    _log(f"[{seen}/{len(results)}] {model_type}: {', '.join(parts)}")


# --- report --------------------------------------------------------------------------------------


def _status(entry: dict[str, Any], name: str) -> str | None:
    doc = entry.get(name)
    return None if doc is None else doc["status"]


def _pct(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.0f}%)" if whole else f"{part}"


def _counts(entries: list[dict[str, Any]], name: str) -> str:
    """``equal X (Y%), refused R, ...`` of one column over ``entries``."""
    statuses = [_status(e, name) for e in entries]
    parts = [f"equal {_pct(statuses.count('equal'), len(entries))}"]
    unsharded = sum(
        _status(e, name) == "equal" and e[name]["detail"].endswith(UNSHARDED) for e in entries
    )
    if unsharded:
        parts[0] += f" (of which {unsharded} shard nothing)"
    for status in ("refused", "error", "different", "n/a"):
        if statuses.count(status):
            parts.append(f"{status} {statuses.count(status)}")
    return ", ".join(parts)


def totals_lines(doc: dict[str, Any]) -> list[str]:
    """The totals of a results document (as ``--json`` writes it), as a markdown list (the
    checks nested under the count that trains eagerly); the README quotes them.

    Example:
        >>> totals_lines(json.load(open("docs/model_coverage.json")))[0]   # --types of 8
        '- 8 of 8 causal-LM architectures train eagerly (tiny, random); of those 8:'
    """
    entries = doc["types"]
    trains = [e for e in entries.values() if _status(e, "eager") == "equal"]
    n = len(trains)
    lines = [
        f"- {n} of {len(entries)} causal-LM architectures train eagerly (tiny, random); "
        f"of those {n}:",
        f"  - recommended schedule: {_counts(trains, 'schedule')}",
        f"  - trace of the first decoder block (no example inputs, two input shapes): "
        f"{_counts(trains, 'trace')}",
    ]
    tp = [e for e in trains if "tp" in e]
    if tp:
        plan = [e for e in tp if e.get("hf_tp_plan")]
        other = [e for e in tp if not e.get("hf_tp_plan")]
        lines.append(
            f"  - TP=2 (gloo): with an HF TP plan ({len(plan)}): {_counts(plan, 'tp')}; "
            f"without one ({len(other)}): {_counts(other, 'tp')}"
        )
    return lines


#: The longest reason a table cell shows (the whole one is in the JSON).
REASON_CHARS = 160


def _cell(text: str) -> str:
    text = text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict[str, Any]) -> str:
    """The coverage report: header, totals, a row per architecture."""
    meta = doc["meta"]
    lines = [
        "# Model coverage",
        "",
        f"Written by `benchmarks/model_coverage.py` on {meta['date']}: transformers "
        f"{meta['transformers']}, torch {meta['torch']}, {meta['threads']} thread(s). Each "
        "causal-LM architecture as a tiny random model (`slapo.testing.zoo_models.tiny_model`: 2 layers, "
        "hidden 64, vocabulary 128, dropout off); each check compares the loss and every "
        "gradient of one training step with the unscheduled model's (rtol 1e-4, atol 1e-5, and "
        "1e-4 of the tensor's largest magnitude for float32 sums in another order). "
        "`refused`: Slapo declined with a typed error; `different`: wrong numbers.",
        "",
        "## Totals",
        "",
        *totals_lines(doc),
        "",
        "## Per architecture",
        "",
        "| model type | eager | schedule | trace | TP=2 | HF TP plan | seconds | why not equal |",
        "| :-- | :-- | :-- | :-- | :-- | :-: | --: | :-- |",
    ]
    for model_type, entry in sorted(doc["types"].items()):
        cells = [_status(entry, name) or "-" for name in COLUMNS]
        reasons = [
            f"{TITLES[name]}: {_cell(entry[name]['detail'])}"
            for name in COLUMNS
            if _status(entry, name) not in (None, "equal")
            and not (name != "eager" and _status(entry, "eager") != "equal")
        ]
        seconds = sum(entry.get("seconds", {}).values())
        lines.append(
            f"| {model_type} | {' | '.join(cells)} | {'yes' if entry.get('hf_tp_plan') else ''} "
            f"| {seconds:.1f} | {'; '.join(reasons)} |"
        )
    return "\n".join(lines) + "\n"


def _meta() -> dict[str, Any]:
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "1")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every one)")
    parser.add_argument("--skip-tp", action="store_true", help="no TP=2 job")
    parser.add_argument("--out", default="docs/model_coverage.md", help="markdown report")
    parser.add_argument("--json", default=None, help="results (default: --out with .json)")
    parser.add_argument("--timeout-per-model", type=float, default=300.0, metavar="S")
    parser.add_argument(
        "--readme-totals", metavar="JSON", help="print the totals of a results file and exit"
    )
    args = parser.parse_args()
    if args.readme_totals:
        print("\n".join(totals_lines(json.loads(Path(args.readme_totals).read_text()))))
        return
    known = zoo.causal_lm_types()
    types = known if not args.types else [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(types) - set(known))
    if unknown:
        parser.error(f"--types: not causal-LM model types: {', '.join(unknown)}")
    json_path = args.json or str(Path(args.out).with_suffix(".json"))
    results: dict[str, dict[str, Any]] = {
        t: {"hf_tp_plan": zoo.has_hf_tp_plan(t), "seconds": {}} for t in types
    }
    started = time.perf_counter()
    _log(f"{len(types)} types, single-process checks ({', '.join(SINGLE_CHECKS)})")
    run_single(types, args.timeout_per_model, results)
    trains = [t for t in types if _status(results[t], "eager") == "equal"]
    if not args.skip_tp and trains:
        _log(f"TP=2 over gloo: {len(trains)} types that train eagerly")
        run_tp(trains, args.timeout_per_model, results)
    doc = {"meta": _meta(), "types": results}
    doc["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    for path, text in ((json_path, json.dumps(doc, indent=1)), (args.out, markdown(doc))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
    _log(f"wrote {args.out} and {json_path} in {doc['meta']['wall_s']} s")
    print("\n".join(totals_lines(doc)))


if __name__ == "__main__":
    main()
