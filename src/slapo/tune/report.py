"""Summaries of a tuning run: a table of the best configurations and a plot of the search."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .space import Space
from .trial import STATUSES

Record = Mapping[str, Any]


def best_table(
    records: Sequence[Record],
    value: Callable[[Record], float | None],
    *,
    objective: str = "throughput",
    maximize: bool = True,
    top: int = 5,
) -> str:
    """Format the ``top`` successful records, best first, plus a count of outcomes.

    Example:
        >>> recs = [{"config": {"bs": 1}, "status": "ok", "result": {"throughput": 2.0},
        ...          "trial": 1, "elapsed_s": 0.1},
        ...         {"config": {"bs": 2}, "status": "oom", "trial": 2, "elapsed_s": 0.1}]
        >>> val = lambda r: r["result"]["throughput"] if r["status"] == "ok" else None
        >>> print(best_table(recs, val))
        rank  trial  throughput  config
        1     1      2           bs=1
        2 trials: 1 ok, 1 oom
    """
    ok = [r for r in records if value(r) is not None]
    ok.sort(key=lambda r: value(r), reverse=maximize)  # type: ignore[arg-type, return-value]
    rows = [["rank", "trial", objective, "config"]]
    for rank, rec in enumerate(ok[:top], start=1):
        rows.append(
            [
                str(rank),
                str(rec.get("trial", "")),
                f"{value(rec):g}",
                Space.cfg_dict_to_str(rec["config"]),
            ]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    lines = [
        "  ".join([*(row[c].ljust(widths[c]) for c in range(3)), row[3]]).rstrip() for row in rows
    ]
    counts: dict[str, int] = {}
    for rec in records:
        counts[rec.get("status", "?")] = counts.get(rec.get("status", "?"), 0) + 1
    order = {status: i for i, status in enumerate(STATUSES)}
    summary = ", ".join(f"{counts[s]} {s}" for s in sorted(counts, key=lambda s: order.get(s, 9)))
    if not ok:
        lines = ["no successful trial"]
    lines.append(f"{len(records)} trials: {summary}" if records else "0 trials")
    return "\n".join(lines)


def plot_search(
    records: Sequence[Record],
    value: Callable[[Record], float | None],
    path: str,
    *,
    objective: str = "throughput",
    maximize: bool = True,
    title: str = "",
) -> bool:
    """Save a PNG of every trial's objective and the best so far; False if matplotlib is
    missing (with a warning) instead of failing the run."""
    try:  # deferred: matplotlib takes ~0.5 s to import and only the plot needs it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "matplotlib is not installed; skipping the search plot (pip install matplotlib)",
            stacklevel=2,
        )
        return False
    # A bare Figure on the Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs_ok, ys_ok, xs_bad = [], [], []
    best_x, best_y, best = [], [], None
    for n, rec in enumerate(records, start=1):
        val = value(rec)
        if val is None:
            xs_bad.append(n)
            continue
        xs_ok.append(n)
        ys_ok.append(val)
        if best is None or (val > best if maximize else val < best):
            best = val
        best_x.append(n)
        best_y.append(best)
    ax.scatter(xs_ok, ys_ok, s=18, label="trial", color="tab:blue")
    if best_x:
        ax.step(best_x, best_y, where="post", color="tab:green", label="best so far")
    if xs_bad:
        floor = min(ys_ok) if ys_ok else 0.0
        ax.scatter(
            xs_bad,
            [floor] * len(xs_bad),
            marker="x",
            color="tab:red",
            label="failed / OOM / timeout",
        )
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title(title or "tuning search")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True
