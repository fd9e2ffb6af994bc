"""The longest sequence one training step fits in a device memory budget: plain PyTorch, FSDP2
with CPU offload, and RoundPipe, side by side.

One step = forward + backward + Adam step of a small Llama (``transformers.LlamaForCausalLM`` from
a config: several layers, a 16 K vocabulary so the logits matter, SDPA attention, batch 1). For each
system the sequence length is stepped up (doubling, then jumping to the length a linear fit of the
measured peaks predicts) and bisected until the longest fitting length is known within
``--tolerance``. A length *fits* when the step's measured device peak is within ``--budget-mb``:

* **plain PyTorch**: the model, its gradients, Adam's state and the activations all live on the
  device. On CPU, the peak of live tensor bytes: a ``TorchDispatchMode`` counting every tensor
  storage created during the step (each storage once, until it is freed) plus the parameters and
  buffers that exist before it (:class:`roundpipe.runtime.activations.LiveBytes`; memory a kernel
  allocates and frees internally is not seen). On CUDA, ``torch.cuda.max_memory_allocated``.
* **FSDP2 + CPUOffloadPolicy** (``fully_shard`` per decoder layer and at the root, one rank; gloo on
  CPU, NCCL on CUDA): parameters, gradients and optimizer state live on the host, each layer's
  parameters are gathered to the device for its compute. On CUDA, ``max_memory_allocated``. On
  CPU the device *is* the host and the offload moves nothing, so the figure is an emulation: the
  same dispatch-mode count of the plain tensors the step creates (gathered parameters,
  activations, logits, unsharded and reduced gradients), the sharded DTensor state (parameters,
  Adam's moments: offloaded on a GPU) left out.
* **RoundPipe**: ``wrap_model_to_roundpipe`` with the Llama preset, ``recompute_grain="layer"``,
  ``return_logits=False`` (chunked head + cross-entropy, ``--chunk`` tokens per chunk), one
  microbatch, stages of ``--blocks-per-stage`` decoder blocks and the head alone as the fused last
  stage; the optimizer runs on the host copy. On CPU, one virtual device with the budget as its
  memory limit and ``ROUNDPIPE_ACCOUNT_ACTIVATIONS=1``: its accounted peak (stage parameters and
  gradients + every storage its stage jobs create, layer inputs handed to the host excluded). On
  CUDA, the GPU's ``max_memory_allocated``.

    .venv/bin/python benchmarks/roundpipe_long_context.py [--budget-mb 160] [--device auto]
        [--layers 4] [--hidden 128] [--vocab 16384] [--tolerance 0.05] [--skip fsdp]

The default run takes about 5-8 minutes on 2 CPU cores (most of it RoundPipe's longest steps).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.devices.device import DeviceMemoryError
from roundpipe.runtime.activations import LiveBytes

MB = 1024 * 1024
# a step's result: (fits, measured peak bytes or None when it failed before the end)
Trial = tuple[bool, int | None]


def make_model(args: argparse.Namespace) -> nn.Module:
    """A small Llama with a sizeable vocabulary (untied head), SDPA attention."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _batch(length: int, vocab: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab, (1, length), generator=gen).to(device)


def _oom_errors() -> tuple[type[BaseException], ...]:
    return (DeviceMemoryError, torch.OutOfMemoryError, MemoryError)


@contextlib.contextmanager
def _cuda_peak() -> Iterator[list[int]]:
    """Yields a list that receives the CUDA allocator's peak over the block."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out: list[int] = []
    try:
        yield out
    finally:
        torch.cuda.synchronize()
        out.append(torch.cuda.max_memory_allocated())


# -- plain PyTorch -----------------------------------------------------------------------------
def plain_step(args: argparse.Namespace, length: int) -> Trial:
    """One training step of the plain model on the device; its peak against the budget."""
    budget = args.budget_mb * MB
    model = make_model(args)
    cuda = args.device == "cuda"
    try:
        if cuda:
            with _cuda_peak() as peak:
                model.cuda()
                _train_step(model, _batch(length, args.vocab, "cuda"))
            return peak[0] <= budget, peak[0]
        live = LiveBytes()
        live.track([*model.parameters(), *model.buffers()])
        with live:
            _train_step(model, _batch(length, args.vocab))
        return live.peak <= budget, live.peak
    except _oom_errors():
        return False, None
    finally:
        del model
        gc.collect()


def _train_step(model: nn.Module, ids: torch.Tensor) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- FSDP2 + CPU offload -----------------------------------------------------------------------
def _init_process_group(cuda: bool) -> None:
    import torch.distributed as dist  # deferred: only this baseline needs it

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


class _PlainLiveBytes(LiveBytes):
    """Counts plain tensors only: FSDP's sharded DTensor state (offloaded on a GPU) is left out."""

    def track(self, tensors: Any) -> None:
        super().track(t for t in tensors if type(t) in (torch.Tensor, nn.Parameter))


def fsdp_step(args: argparse.Namespace, length: int) -> Trial:
    """One training step under FSDP2 with CPUOffloadPolicy on one rank."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # deferred: optional

    cuda = args.device == "cuda"
    _init_process_group(cuda)
    budget = args.budget_mb * MB
    model = make_model(args)
    try:
        policy = CPUOffloadPolicy(pin_memory=cuda)  # pinning needs an accelerator
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        if cuda:
            with _cuda_peak() as peak:
                _train_step(model, _batch(length, args.vocab, "cuda"))
            return peak[0] <= budget, peak[0]
        live = _PlainLiveBytes()
        with live:
            _train_step(model, _batch(length, args.vocab))
        return live.peak <= budget, live.peak
    except _oom_errors():
        return False, None
    finally:
        del model
        gc.collect()


# -- RoundPipe ---------------------------------------------------------------------------------
def roundpipe_plan(num_blocks: int, per_stage: int) -> ModelExecutePlan:
    """Embedding with the first blocks | blocks in groups of ``per_stage`` | the head (fused)."""
    n = num_blocks + 2
    bounds = [0, *range(1 + per_stage, n - 1, per_stage), n - 1, n]
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    plan.bwd_plan = plan.fwd_plan[::-1]
    plan.check_valid(n, "fused")
    return plan


def roundpipe_step(args: argparse.Namespace, length: int) -> Trial:
    """One RoundPipe training step; the device's peak against the budget."""
    budget = args.budget_mb * MB
    cuda = args.device == "cuda"
    if cuda:
        roundpipe.init_devices(backend="cuda")
    else:
        os.environ["ROUNDPIPE_ACCOUNT_ACTIVATIONS"] = "1"
        roundpipe.init_devices(num_virtual=1, memory_limit=budget)
    model = make_model(args)
    cfg = RoundPipeRunConfig(
        num_microbatch=1,
        recompute_grain="layer",
        execute_plan=roundpipe_plan(args.layers, args.blocks_per_stage),
    )
    rp = wrap_model_to_roundpipe(model, model_run_config=cfg)
    rp.layers[-1].chunk_size = args.chunk
    opt = torch.optim.Adam(rp.optim_parameters(), lr=1e-4)
    ids = _batch(length, args.vocab)
    kwargs = {"input_ids": ids, "labels": ids, "return_logits": False}
    try:
        if cuda:
            with _cuda_peak() as peak:
                rp.forward_backward(input_kwargs=kwargs)
                rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            return peak[0] <= budget, peak[0]
        dev = roundpipe.get_devices()[0]
        dev.memory.reset_peak()
        rp.forward_backward(input_kwargs=kwargs)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        roundpipe.device.wait_devices_idle(timeout=600)
        return dev.memory.peak <= budget, dev.memory.peak
    except _oom_errors():
        return False, None
    except RuntimeError as exc:  # a worker's DeviceMemoryError, re-raised by the run
        if "budget" in str(exc) or "out of memory" in str(exc).lower():
            return False, None
        raise
    finally:
        roundpipe.device.wait_devices_idle(timeout=600)
        gc.collect()


# -- search ------------------------------------------------------------------------------------
def _round(length: float, quantum: int) -> int:
    return max(quantum, int(length) // quantum * quantum)


def longest(
    name: str,
    step: Callable[[argparse.Namespace, int], Trial],
    args: argparse.Namespace,
) -> tuple[int, int | None]:
    """The longest length (a multiple of ``args.quantum``) whose step fits, and its peak."""
    q, budget = args.quantum, args.budget_mb * MB
    lo, lo_peak, hi = 0, None, None
    points: list[tuple[int, int]] = []  # (length, peak) of steps that fit
    length = _round(args.start, q)
    while True:
        t0 = time.perf_counter()
        fits, peak = step(args, length)
        shown = "failed" if peak is None else f"{peak / MB:8.1f} MiB"
        print(
            f"  {name:<10} len {length:>7}: peak {shown}  "
            f"{'fits' if fits else 'over'}  ({time.perf_counter() - t0:5.1f} s)",
            flush=True,
        )
        if fits:
            lo, lo_peak = length, peak
            points.append((length, peak or 0))
        else:
            hi = length if hi is None else min(hi, length)
        if lo == 0 and hi is not None:  # not even the start fits: step down
            if hi <= q:
                return 0, None
            length = _round(hi / 2, q)
            continue
        if hi is not None and hi - lo <= max(q, args.tolerance * lo):
            return lo, lo_peak
        if lo >= args.max_len:
            return lo, lo_peak
        guess = _predict(points, budget)
        upper = hi if hi is not None else min(lo * 4, args.max_len + q)
        if guess is None or not lo < guess < upper:
            guess = (lo + upper) / 2 if hi is not None else lo * 2
        # aim just below the prediction (a fit) or just above it (confirms the bound)
        length = _round(guess * (0.99 if hi is None else 1.0), q)
        if hi is not None and length >= hi:
            length = _round((lo + hi) / 2, q)
        if length <= lo:
            length = lo + q
        length = min(length, args.max_len)


def _predict(points: list[tuple[int, int]], budget: int) -> float | None:
    """Length where a line through the two longest fitting steps reaches the budget."""
    if len(points) < 2:
        return None
    (l1, p1), (l2, p2) = sorted(points)[-2:]
    if p2 <= p1 or l2 == l1:
        return None
    return l2 + (budget - p2) * (l2 - l1) / (p2 - p1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mb", type=float, default=160.0, help="device memory budget")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=352)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=256, help="RoundPipe head chunk (tokens)")
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--start", type=int, default=256, help="first length tried")
    parser.add_argument("--quantum", type=int, default=64, help="lengths are multiples of it")
    parser.add_argument("--max-len", type=int, default=1 << 17)
    parser.add_argument("--tolerance", type=float, default=0.05, help="relative search width")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["plain", "fsdp", "roundpipe"])
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()

    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(
        f"Llama: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.heads} heads, vocab {args.vocab}, {n_params / 1e6:.1f} M params (fp32, SDPA); "
        f"batch 1, Adam; budget {args.budget_mb:g} MiB on {args.device}"
    )
    systems = {
        "plain": ("plain PyTorch", plain_step),
        "fsdp": ("FSDP2+CPUOffload", fsdp_step),
        "roundpipe": ("RoundPipe", roundpipe_step),
    }
    results: dict[str, tuple[int, int | None]] = {}
    for key, (name, step) in systems.items():
        if key in args.skip:
            continue
        print(f"{name}:", flush=True)
        results[key] = longest(key, step, args)
    print()
    print(f"{'system':<22}{'longest seq':>12}{'peak MiB':>10}{'x plain':>9}")
    base = results.get("plain", (0, None))[0]
    for key, (length, peak) in results.items():
        ratio = f"{length / base:.1f}x" if base else "n/a"
        shown = f"{peak / MB:.1f}" if peak else "-"
        print(f"{systems[key][0]:<22}{length:>12}{shown:>10}{ratio:>9}")
    if args.device == "cpu" and "fsdp" in results:
        print(
            "FSDP on CPU: the offload moves nothing (host and device are one memory); its figure "
            "counts the plain tensors a GPU would hold (sharded state excluded)."
        )
    if base and "roundpipe" in results:
        ratio = results["roundpipe"][0] / base
        print(
            f"RoundPipe / plain PyTorch: {ratio:.1f}x (goal >= 6x: {'met' if ratio >= 6 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
