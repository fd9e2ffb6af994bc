"""Data-parallel jobs (run in spawned gloo workers): DDP and FSDP2 against one process."""

from __future__ import annotations

import torch

import hf_models
import slapo
from slapo.exceptions import TargetError

STEPS = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
# SGD, not Adam: Adam divides by sqrt of tiny second moments (e.g. attention key biases, whose
# gradient is ~0), which turns summation-order noise into large parameter differences.
OPT = {"lr": 0.1, "momentum": 0.9}


def batches(n: int = STEPS, size: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(1, hf_models.VOCAB, (size, hf_models.SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train(model, opt, data, rank: int = 0, world: int = 1) -> None:
    """``STEPS`` optimizer steps; each rank takes its contiguous slice of every batch."""
    for full in data:
        per = full["input_ids"].shape[0] // world
        part = {k: v[rank * per : (rank + 1) * per] for k, v in full.items()}
        opt.zero_grad(set_to_none=True)
        model(**part).loss.backward()
        opt.step()


def reference(family: str) -> dict[str, torch.Tensor]:
    model = hf_models.make(family, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), **OPT)
    train(model, opt, batches())
    return {n: p.detach() for n, p in model.named_parameters()}


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def check_target(family: str, target: str, rank: int, world: int, **kwargs) -> None:
    ref = reference(family)
    sch = slapo.create_schedule(hf_models.make(family, dropout=0.0))
    model, opt = slapo.build(
        sch, target=target, optimizer=torch.optim.SGD, optimizer_kwargs=OPT, **kwargs
    )
    train(model, opt, batches(), rank, world)
    names = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    assert set(names) == set(ref), set(names) ^ set(ref)
    for name, p in names.items():
        torch.testing.assert_close(full(p).detach(), ref[name], **TOL, msg=lambda m, n=name: n + m)


def check_dp_tp(family: str, target: str, rank: int, world: int) -> None:
    """Data x tensor parallel on a 2x2 mesh: every rank holds its tensor shard of one process."""
    import plans
    from torch.distributed.device_mesh import init_device_mesh

    from slapo.sharding import get_shard_spec

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    ref = reference(family)
    sch = slapo.create_schedule(hf_models.make(family, dropout=0.0), group=mesh["tp"])
    plans.PLANS[family](sch, world // 2)
    # Read before the build: FSDP2 swaps in new parameter objects.
    specs = {n: get_shard_spec(p) for n, p in sch.mod.named_parameters()}
    model, opt = slapo.build(
        sch, target=target, group=mesh["dp"], optimizer=torch.optim.SGD, optimizer_kwargs=OPT
    )
    train(model, opt, batches(), mesh["dp"].get_local_rank(), 2)
    names = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    assert set(names) == set(specs), set(names) ^ set(specs)
    for name, p in names.items():
        want = ref[name] if specs[name] is None else specs[name].local_slice(ref[name])
        torch.testing.assert_close(full(p).detach(), want, **TOL, msg=lambda m, n=name: n + m)


def check_replicated_grads(target: str, world: int) -> None:
    """Qwen3's ready schedule on a dp x tp mesh: its per-head norms stay whole while their heads
    are split, and their gradients are summed over the tensor ranks by a parameter hook
    (``sync(mode="bwd_param")``). FSDP2 swaps the parameter objects (sharded DTensors, and the
    unsharded ones forward and backward use): the sums must still happen, once."""
    from torch.distributed.device_mesh import init_device_mesh

    from slapo.model_schedule import apply_schedule
    from slapo.sharding import get_shard_spec
    from slapo.testing.zoo_models import tiny_model

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1))
    ref = tiny_model("qwen3")
    ref(input_ids=ids, labels=ids).loss.backward()
    sch = apply_schedule(tiny_model("qwen3"), group=mesh["tp"], ckpt_ratio=0.0)
    specs = {n: get_shard_spec(p) for n, p in sch.mod.named_parameters()}
    model, _ = slapo.build(sch, target=target, group=mesh["dp"])
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    for _ in range(2):  # the second step: the hooks hold on the re-gathered parameters
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
    norms = 0
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        want = ref.get_parameter(name).grad
        want = want if specs[name] is None else specs[name].local_slice(want)
        norms += "q_norm" in name
        torch.testing.assert_close(full(p.grad), want, **TOL, msg=lambda m, n=name: n + m)
    assert norms, "no per-head norm checked"


def check_fsdp_blocks() -> None:
    from torch.distributed.fsdp import FSDPModule

    sch = slapo.create_schedule(hf_models.make("llama", dropout=0.0))
    model, _ = slapo.build(sch, target="fsdp")
    assert isinstance(model.model.layers[0], FSDPModule) and isinstance(model, FSDPModule)


def check_fsdp_mixed_precision() -> None:
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    model, opt = slapo.build(
        sch,
        target="fsdp",
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    loss = model(**hf_models.batch()).loss
    assert loss.dtype == torch.float32 or loss.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # fp32 master grads
    ref = hf_models.make("gpt2", dropout=0.0)
    torch.testing.assert_close(loss.float(), ref(**hf_models.batch()).loss, rtol=0.05, atol=0.05)


def check_bad_options() -> None:
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    for kwargs, text in [
        ({"wrap": ["transformer.nope"]}, "transformer.nope"),
        ({"mp_policy": object(), "param_dtype": torch.bfloat16}, "mp_policy"),
        ({"group": "dp"}, "group="),
    ]:
        try:
            slapo.build(sch, target="fsdp", **kwargs)
        except TargetError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"no TargetError for {kwargs}")


def dp_checks(rank: int, world: int) -> dict:
    """Checks of the 2-rank job: DDP and FSDP2 over every rank."""
    return {
        "ddp_gpt2": lambda: check_target("gpt2", "ddp", rank, world),
        "fsdp_gpt2": lambda: check_target("gpt2", "fsdp", rank, world),
        "fsdp_llama": lambda: check_target("llama", "fsdp", rank, world),
        "fsdp_blocks": check_fsdp_blocks,
        "fsdp_mixed_precision": check_fsdp_mixed_precision,
        "bad_options": check_bad_options,
    }


def dp_tp_checks(rank: int, world: int) -> dict:
    """Checks of the 4-rank job: data x tensor parallel on a 2x2 mesh."""
    return {
        "ddp_tp_llama": lambda: check_dp_tp("llama", "ddp", rank, world),
        "fsdp_tp_gpt2": lambda: check_dp_tp("gpt2", "fsdp", rank, world),
        "fsdp_tp_replicated_grads": lambda: check_replicated_grads("fsdp", world),
        "ddp_tp_replicated_grads": lambda: check_replicated_grads("ddp", world),
    }
