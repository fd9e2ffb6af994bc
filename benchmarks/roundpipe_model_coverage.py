"""Which transformers causal-LM types RoundPipe's generic preset runs exactly as plain PyTorch.

For every causal-LM ``model_type`` (tiny random configs from :mod:`slapo.testing`): a
Llama-style model is cut by the generic preset (:mod:`roundpipe.models.generic_preset`, bypassing its
allowlist) and run in 2 microbatches on one CPU virtual device; its loss (router loss included,
``output_router_logits=True`` on mixtures of experts) and every gradient are compared with the
plain model's. The types that come out equal are what ``GENERIC_MODEL_TYPES`` lists.

Run: ``.venv/bin/python benchmarks/roundpipe_model_coverage.py [model_type ...]``
(``--python-list`` prints the equal types as a Python frozenset).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections import Counter

os.environ.setdefault("ROUNDPIPE_VIRTUAL_DEVICES", "1")

import torch  # noqa: E402

import slapo.testing as zoo  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.models import SUPPORTED_MODELS, generic  # noqa: E402
from roundpipe.models.moe import install_router_hooks  # noqa: E402


def check(model_type: str) -> tuple[str, str]:
    """``(status, detail)`` of one model type: equal, different, error, not-llama-style, n/a."""
    try:
        ref = zoo.tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001  (a type the zoo cannot build is reported, not fatal)
        return "n/a", f"{type(exc).__name__}: {exc}"[:120]
    if not generic.is_llama_style(ref):
        return "not-llama-style", ""
    hf = copy.deepcopy(ref)
    moe = install_router_hooks(hf) > 0
    batch = zoo.sample_batch(ref, batch=2, seq=16)
    if set(batch) - {"input_ids", "labels"}:
        return "n/a", f"inputs {sorted(batch)}"
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, 12:] = 0
    extra = {"output_router_logits": True} if moe else {}
    try:
        rp = generic.wrap(
            hf, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        want = ref(**batch, **extra)
        want.loss.backward()
        got = rp(**batch, **extra)
        got.loss.backward()
    except Exception as exc:  # noqa: BLE001
        return "error", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160]
    result = zoo.compare_grads(
        want.loss.detach(),
        got.loss.detach(),
        {n: p.grad for n, p in ref.named_parameters()},
        {n: p.grad for n, p in hf.named_parameters()},
    )
    kind = "moe" if moe else "dense"
    return result.status, f"{kind}: {result.detail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--python-list", action="store_true", help="print the equal types")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts: Counter[str] = Counter()
    equal = []
    for model_type in args.types or zoo.causal_lm_types():
        status, detail = check(model_type)
        counts[status] += 1
        if status == "equal":  # under the name find_preset reads (emu3 -> emu3_text_model)
            name = zoo.tiny_model(model_type).config.model_type
            if name not in SUPPORTED_MODELS and name not in equal:
                equal.append(name)
        print(f"{model_type:32s} {status:16s} {detail}", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if args.python_list:
        print("frozenset({" + ", ".join(f'"{t}"' for t in sorted(equal)) + "})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
