"""RoundPipe on one CUDA GPU, side by side in one run (needs a GPU; `scripts/gpu-check.sh` runs it).

1. Overhead on a model that fits: an MLP stack trained by plain PyTorch (everything resident on
   the GPU, fused AdamW there) and by RoundPipe (weights, gradients and Adam state in pinned host
   memory, layers streamed in, C++ CPU Adam stepping asynchronously). Ratio of step times.
2. A Llama of about 1.1B parameters (TinyLlama's shape, random weights) that RoundPipe and
   FSDP2 with ``CPUOffloadPolicy`` both keep in host memory, on one GPU: tokens/s of each.
   Both train in bf16 with fp32 master weights and Adam state on the host.

    python benchmarks/roundpipe_cuda.py [--part overhead|llama|all] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import time
from collections.abc import Callable

import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig


def _timed(step: Callable[[], None], finish: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds per step over ``steps`` back-to-back steps, after ``warmup`` ones.

    ``finish`` (wait for all device and optimizer work) runs once at the end, so an
    asynchronous optimizer step overlaps the next iteration as it does in training.
    """
    for _ in range(warmup):
        step()
    finish()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    finish()
    return (time.perf_counter() - t0) / steps


def _mlp(n_layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)]
    )


def overhead(steps: int, n_layers: int = 16, width: int = 4096, rows: int = 16384) -> dict:
    """Plain PyTorch on the GPU against RoundPipe streaming the same MLP (bf16 compute).

    Activations travel through host memory between stages, so RoundPipe's cost grows with
    ``rows`` too (on an H100: 7.9x plain at 16384 rows, 7.0x at 65536).
    """
    roundpipe.init_devices(backend="cuda")
    x = torch.randn(rows, width, device="cuda")
    y = torch.randn(rows, width, device="cuda")
    ref = _mlp(n_layers, width).cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)

    def plain_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(ref(x).float(), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    plain = _timed(plain_step, torch.cuda.synchronize, steps, warmup=2)
    ref_opt.state.clear()  # free the GPU-resident run's optimizer state before RoundPipe's run
    torch.cuda.empty_cache()

    n_mb = 4
    net = _mlp(n_layers, width).to(torch.bfloat16)
    model = RoundPipe(
        net,
        optim_dtype=torch.float32,
        pin_model="alloc",
        model_run_config=RoundPipeRunConfig(num_microbatch=n_mb),
    )
    opt = roundpipe.Adam(model.optim_parameters(), lr=1e-4)
    xh, yh = x.to(torch.bfloat16).cpu().pin_memory(), y.cpu().pin_memory()

    def rp_step() -> None:
        model.forward_backward(
            (xh,), label=yh, loss_fn=lambda o, t: nn.functional.mse_loss(o.float(), t) / n_mb
        )
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)

    rp = _timed(rp_step, model.synchronize, steps, warmup=2)
    params = n_layers * (width * width + width)
    return {
        "model": f"MLP {n_layers}x{width} ({params / 1e6:.0f}M params), {rows} rows",
        "plain PyTorch (resident, fused AdamW on GPU) s/step": plain,
        "RoundPipe (host state, C++ Adam async) s/step": rp,
        "RoundPipe / plain": rp / plain,
    }


def _llama(layers: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def llama(steps: int, layers: int = 22, batch: int = 8, seq: int = 1024) -> dict:
    """Tokens/s of RoundPipe and of FSDP2 with CPU offload on a ~1.1B Llama, one GPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import slapo

    ids = torch.randint(0, 32000, (batch, seq))
    tokens = batch * seq
    base = _llama(layers)
    n_params = sum(p.numel() for p in base.parameters())

    # FSDP2: fp32 sharded parameters offloaded to host memory, bf16 compute, AdamW on the host
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    fsdp_model = copy.deepcopy(base)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in fsdp_model.model.layers:
        fully_shard(block, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
    fully_shard(fsdp_model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-5)
    dev_ids = ids.cuda()

    def fsdp_step() -> None:
        loss = fsdp_model(input_ids=dev_ids, labels=dev_ids).loss
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()

    fsdp = _timed(fsdp_step, torch.cuda.synchronize, steps, warmup=1)
    fsdp_opt.state.clear()
    dist.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()

    # RoundPipe through slapo: bf16 model, fp32 optimizer copies, C++ Adam asynchronous
    roundpipe.init_devices(backend="cuda")
    net = base.to(torch.bfloat16)
    sch = slapo.create_schedule(net)
    model, opt = slapo.build(
        sch,
        target="roundpipe",
        num_microbatch=4,
        optimizer=roundpipe.Adam,
        optimizer_kwargs={"lr": 1e-5},
        async_step=True,
        optim_dtype=torch.float32,
    )
    data = {"input_ids": ids, "labels": ids}

    def rp_step() -> None:
        slapo.train_step(model, data)
        opt.step()
        opt.zero_grad()

    rp = _timed(rp_step, model.synchronize, steps, warmup=1)
    return {
        "model": f"Llama {n_params / 1e9:.2f}B params, {layers} layers, batch {batch}x{seq}",
        "FSDP2 + CPUOffloadPolicy tokens/s": tokens / fsdp,
        "RoundPipe tokens/s": tokens / rp,
        "RoundPipe / FSDP2-offload (tokens/s)": fsdp / rp,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["overhead", "llama", "all"], default="all")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/roundpipe_cuda.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = {}
    if args.part in ("overhead", "all"):
        results["overhead"] = overhead(args.steps)
    if args.part in ("llama", "all"):
        results["llama"] = llama(args.steps)
    for part, rows in results.items():
        print(f"\n[{part}] {rows.pop('model')}")
        for name, value in rows.items():
            print(f"  {name:<52}{value:>12.3f}")


if __name__ == "__main__":
    main()
