"""The README's quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs_and_trains(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102  (our own README)
    model = scope["model"]
    assert not any(p.is_meta for p in model.parameters())
    assert all(model.model.layers[i].mlp.up_proj.weight.grad is not None for i in range(4))
    assert "[checkpoint()]" in capsys.readouterr().out
