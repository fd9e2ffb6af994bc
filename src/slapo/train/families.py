"""The built-in model families of ``slapo train --model`` and their sizes (``--preset``): data
that the presets, the model sources and the config all read.

Example:
    >>> PRESETS["tiny"], "llama" in CAUSAL
    ((128, 4, 4, 2, 352), True)
"""

from __future__ import annotations

__all__ = ["CAUSAL", "MODELS", "PRESETS"]

MODELS = ("llama", "gpt2", "bert", "opt", "t5")
CAUSAL = ("llama", "gpt2", "opt")

# name -> (hidden, layers, heads, kv heads, intermediate)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 4, 4, 2, 352),
    "small": (256, 6, 8, 4, 688),
    "base": (512, 8, 8, 4, 1376),
}
