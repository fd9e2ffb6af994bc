"""The README's code runs as written: the quick start and the one training loop."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import slapo
from hf_models import make

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs_and_trains(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102  (our own README)
    model = scope["model"]
    assert not any(p.is_meta for p in model.parameters())
    assert all(model.model.layers[i].mlp.up_proj.weight.grad is not None for i in range(4))
    assert "[checkpoint()]" in capsys.readouterr().out


def test_the_one_training_loop_runs_as_written():
    """The README's "One training loop" block trains a built model (eager here; every target in
    tests/targets/test_contract.py)."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
                 if "slapo.train_step" in b)  # fmt: skip
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    losses: list = []
    scope = {
        "torch": torch,
        "slapo": slapo,
        "sch": slapo.create_schedule(make("gpt2", dropout=0.0)),
        "target": None,
        "options": {"optimizer_kwargs": {"lr": 1e-2}},
        "batches": [{"input_ids": ids, "labels": ids}] * 4,
    }
    code = block.replace(
        "optimizer.zero_grad()", "optimizer.zero_grad(); losses.append(float(loss))"
    )
    exec(compile(code, str(README), "exec"), {**scope, "losses": losses})  # noqa: S102
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_the_readme_states_the_lower_bounds_pyproject_declares():
    """The "Supported versions" paragraph and pyproject.toml's dev extra name the same bounds
    (scripts/test-deps.sh tests the ones in pyproject.toml)."""
    import tomllib

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    lows = dict(re.match(r"([a-z-]+)>=([0-9.]+)", req).groups() for req in dev if ">=" in req)
    section = README.read_text().split("### Supported versions", 1)[1].split("\n#", 1)[0]
    prose = " ".join(section.split())
    assert f"`transformers` {lows['transformers']} to the newest" in prose
    for name in ("peft", "deepspeed", "accelerate"):
        assert f"`{name}` >= {lows[name]}" in prose, name


def _between(text: str, start: str, end: str) -> list[str]:
    body = text.split(start, 1)[1].split(end, 1)[0]
    return [line for line in body.strip().splitlines() if line.strip()]


def test_the_readme_quotes_the_committed_coverage_totals():
    # docs/model_coverage.md is written by benchmarks/model_coverage.py (the whole sweep); the
    # README's totals must be its totals, not numbers typed by hand.
    coverage = (README.parent / "docs" / "model_coverage.md").read_text()
    totals = _between(coverage, "## Totals", "## Per architecture")
    quoted = _between(README.read_text(), "<!-- coverage:begin -->", "<!-- coverage:end -->")
    assert totals and quoted == totals
