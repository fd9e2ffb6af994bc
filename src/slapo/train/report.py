"""What a run leaves: ``metrics.json`` and ``loss.png``, and the end-of-run table.

Example:
    >>> from slapo.train import TrainConfig, train
    >>> # three real training steps take 10-30 seconds on a laptop CPU: not run by the test suite
    >>> print(format_summary(train(TrainConfig(steps=3, progress=False))))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["format_summary", "write_outputs"]


def write_outputs(out: Path, summary: dict[str, Any], runs: list[dict[str, Any]]) -> Path | None:
    """Write ``metrics.json`` (atomically, first) and then ``loss.png`` into ``out``.

    Returns the plot's path, or None when it was skipped. The plot never costs a run its
    results: without matplotlib (or if drawing fails) one line on stderr says why and how to
    get it, and the metrics are already on disk.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp())
        >>> s = {"config": {"model": "llama", "preset": "tiny"}, "losses": [2.0, 1.5]}
        >>> write_outputs(out, s, [{"label": "scheduled", "losses": [2.0, 1.5]}]).name
        'loss.png'
    """
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "metrics.json")
    plot = out / "loss.png"
    try:  # deferred: matplotlib is optional, and slow to import
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(
            f"slapo train: skipped {plot}: matplotlib is not installed (pip install matplotlib); "
            f"the metrics are in {out / 'metrics.json'}",
            file=sys.stderr,
        )
        return None
    try:
        # A bare Figure on an Agg canvas: no pyplot state, no display, the caller's backend kept.
        fig = Figure(figsize=(10, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax, mem = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for run in runs:
            ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=run["label"])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"slapo train: {summary['config']['model']} ({summary['config']['preset']})")
        ax.legend()
        _memory_bars(mem, runs)
        fig.tight_layout()
        fig.savefig(plot, format="png")
    except Exception as exc:  # noqa: BLE001  (the plot is a by-product; the metrics are safe)
        print(
            f"slapo train: skipped {plot}: drawing it failed ({type(exc).__name__}: {exc}); "
            f"the metrics are in {out / 'metrics.json'}",
            file=sys.stderr,
        )
        return None
    return plot


def _memory_bars(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Peak memory per run: measured beside estimated (where there is an estimate)."""
    labels = [run["label"] for run in runs]
    measured = [run.get("peak_memory_mb") or 0.0 for run in runs]
    estimated = [run.get("estimated_peak_mb") or 0.0 for run in runs]
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured peak")
    if any(estimated):
        ax.bar([x + 0.2 for x in xs], estimated, width=0.4, label="estimated before the run")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("MiB")
    ax.set_title("peak memory of a step")
    ax.legend()


def _estimate_cell(run: dict[str, Any]) -> str:
    """The estimate made before the run, and how far the measured peak came from it."""
    est = run.get("estimated_peak_mb")
    if est is None:
        return "n/a"
    measured = run.get("peak_memory_mb") or 0.0
    off = f" ({(est - measured) / measured:+.0%})" if measured > 0 else ""
    return f"{est:,.1f}{off}"


def _rank_lines(summary: dict[str, Any]) -> list[str]:
    """The layout and, with several processes, what each rank holds: parameters, measured peak
    and the estimate made before the run."""
    ranks = summary.get("ranks") or []
    if len(ranks) < 2:
        return []
    lines = [f"layout: {summary.get('layout')}", "  rank  parameters  peak (MiB)  estimate (MiB)"]
    for r in ranks:
        est = r["estimated_peak_mb"]
        lines.append(
            f"  {r['rank']:>4}  {r['parameters']:>10,}  {r['peak_memory_mb']:>10,.1f}  "
            f"{'n/a' if est is None else f'{est:,.1f}':>14}"
        )
    return lines


def _mfu_cell(run: dict[str, Any]) -> str:
    """Model FLOPs utilization: the FLOPs the tokens/s need over the devices' peak."""
    if run.get("mfu") is None:
        return "n/a"  # no peak known (the CPU, an unknown GPU): --peak-tflops gives one
    return f"{100 * run['mfu']:.1f}% of {run['peak_tflops']:g} TFLOPS"


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table; with ``--compare``, the baseline and the scheduled run side by side."""
    runs = [summary["baseline"], summary] if "baseline" in summary else [summary]
    cfg = summary["config"]

    def cells(run: dict[str, Any]) -> list[str]:
        return [
            f"{run['parameters']:,}",
            str(run["checkpointed_layers"]),
            f"{run['first_loss']:.3f} -> {run['final_loss']:.3f}",
            f"{run['tokens_per_s']:,.0f}",
            _mfu_cell(run),
            f"{run['peak_memory_mb']:,.1f}",
            f"{run['activation_mb']:,.1f}",
            _estimate_cell(run),
            f"{run['seconds']:.1f}",
        ]

    names = [
        "parameters", "checkpointed layers", "loss (first -> last 10 mean)", "tokens/s",
        "MFU", "peak memory (MiB)", "  of which saved activations", "estimated peak (MiB)", "time (s)",
    ]  # fmt: skip
    cols = [cells(r) for r in runs]
    header = [""] + [
        (f"unscheduled ({len(r['losses'])} steps)" if i == 0 and len(runs) > 1 else "scheduled")
        for i, r in enumerate(runs)
    ]
    width = max(len(n) for n in names)
    colw = [max(len(header[j + 1]), *(len(cell) for cell in col)) for j, col in enumerate(cols)]
    lines = [
        "",
        f"slapo train: {cfg['model']} ({cfg['preset']}), {cfg['steps']} steps, target "
        f"{summary.get('target', cfg['target'])}, {summary['world_size']} process(es)",
        "-" * (width + 2 + sum(w + 2 for w in colw)),
        f"{'':<{width}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(header[1:], colw)),
    ]
    for i, name in enumerate(names):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c[i]:>{w}}" for c, w in zip(cols, colw)))
    lines += _rank_lines(summary)
    if summary.get("placement"):
        lines.append(f"device: {summary['placement']}")
    if len(runs) > 1 and runs[0]["tokens_per_s"] and runs[0]["peak_memory_mb"]:
        speed = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
        memory = runs[1]["peak_memory_mb"] / runs[0]["peak_memory_mb"]
        lines.append(f"{'scheduled / unscheduled':<{width}}  {speed:.2f}x tokens/s, "
                     f"{memory:.2f}x peak memory")  # fmt: skip
    if summary.get("data"):
        count = f", {summary['tokens']:,} tokens" if summary.get("tokens") else ""
        lines.append(f"data: {summary['data']} ({summary['tokenizer']} tokenizer{count})")
    if summary.get("eval"):
        last = summary["eval"][-1]
        lines.append(
            f"eval: loss {last['loss']:.3f}, perplexity {last['perplexity']:,.2f} after step "
            f"{last['step']} ({summary.get('eval_data')})"
        )
    if summary.get("resumed_from"):
        lines.append(f"resumed: from {summary['resumed_from']} at step {summary['resumed_at']}")
    if summary.get("saved"):
        lines.append(f"saved: {summary['saved']} (from_pretrained loads it; --resume continues)")
    if summary.get("plan"):
        lines.append(f"plan: {summary['plan']}")
    if summary.get("knobs"):
        knobs = ", ".join(f"{k}={v}" for k, v in summary["knobs"].items() if k != "group")
        lines.append(f"schedule: {knobs}")
    if summary.get("sample"):
        lines += ["", "text from the trained model:", *("  " + s for s in summary["sample"])]
    return "\n".join(lines)
