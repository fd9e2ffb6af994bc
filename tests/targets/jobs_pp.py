"""Pipeline jobs (run in spawned gloo workers): single-process loss and gradients are the oracle."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_models
import slapo
from slapo.exceptions import TargetError
from slapo.pipeline import PipelineError

MICRO = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}
CUTS = {
    ("gpt2", 2): ["transformer.h.0"],
    ("gpt2", 4): ["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
    ("llama", 2): ["model.layers.1"],
    ("llama", 4): ["model.layers.0", "model.layers.1", "model.layers.2"],
}
# A cut right after the embeddings: stage 0 hands on a value that only stage 2 uses.
GPT2_AT_DROP = ["transformer.drop", "transformer.h.0", "transformer.h.1"]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make(family: str) -> nn.Module:
    return hf_models.make(family, dropout=0.0, **({"layers": 4} if family == "llama" else {}))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        1, hf_models.VOCAB, (4, hf_models.SEQ), generator=torch.Generator().manual_seed(3)
    )
    return ids, torch.roll(ids, -1, dims=1)


def reference(family: str, micro: int = MICRO) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean microbatch loss of one process, and the gradient of every name of every parameter."""
    model = make(family)
    ids, labels = data()
    losses = [
        loss_fn(model(input_ids=x, use_cache=False).logits, y)
        for x, y in zip(ids.chunk(micro), labels.chunk(micro))
    ]
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads


def build(family: str, stages: int, schedule: str, cuts=None, micro: int = MICRO):
    sch = slapo.create_schedule(make(family))
    for path in cuts or CUTS[(family, stages)]:
        sch[path].cut_pipeline_stage()
    return slapo.build(
        sch,
        target="pipeline",
        schedule=schedule,
        num_microbatches=micro,
        loss_fn=loss_fn,
        example_inputs=data()[0],
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
    )


def check_equivalence(
    family: str, stages: int, schedule: str, cuts=None, micro: int = MICRO
) -> None:
    ref_loss, ref_grads = reference(family, micro)
    engine, _ = build(family, stages, schedule, cuts, micro)
    ids, labels = data()
    loss = engine.step(ids, target=labels)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    names = [n for n, _ in engine.named_parameters()]
    assert names and set(names) <= set(ref_grads), set(names) - set(ref_grads)
    for name, p in engine.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad, ref_grads[name], **TOL, msg=lambda m, n=name: n + m)


def check_pp_tp(family: str, world: int) -> None:
    """2 stages x 2 tensor ranks: the single-process loss, and each rank's slice of the grads."""
    import plans
    from torch.distributed.device_mesh import init_device_mesh

    from slapo.sharding import get_shard_spec

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    ref_loss, ref_grads = reference(family)
    sch = slapo.create_schedule(make(family), group=mesh["tp"])
    plans.PLANS[family](sch, world // 2, **({"vocab_parallel": False} if family == "gpt2" else {}))
    specs = {n: get_shard_spec(p) for n, p in sch.mod.named_parameters(remove_duplicate=False)}
    sch[CUTS[(family, 2)][0]].cut_pipeline_stage()
    engine, _ = slapo.build(
        sch,
        target="pipeline",
        schedule="1F1B",
        num_microbatches=MICRO,
        loss_fn=loss_fn,
        example_inputs=data()[0],
        group=mesh,
    )
    ids, labels = data()
    loss = engine.step(ids, target=labels)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    sharded = 0
    for name, p in engine.named_parameters():
        spec = specs[name]
        sharded += spec is not None
        want = ref_grads[name] if spec is None else spec.local_slice(ref_grads[name])
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name: n + m)
    assert sharded, "no tensor-parallel parameter on this stage"


def check_dp_pp_tp(family: str, world: int, tp: int, data_parallel: str = "ddp") -> None:
    """dp x 2 stages x tp: each data-parallel rank steps on its slice of the batch; the loss is
    the whole batch's, every gradient (slice) the single process's, clipping uses its norm, and
    a second step without zero_grad accumulates once more."""
    import plans
    from torch.distributed.device_mesh import init_device_mesh

    from slapo.sharding import get_shard_spec

    dp = world // (2 * tp)
    mesh = init_device_mesh("cpu", (dp, 2, tp), mesh_dim_names=("dp", "pp", "tp"))
    # one process: the whole batch in dp * MICRO microbatches, as the replicas split it
    ref_loss, ref_grads = reference(family, micro=dp * MICRO)
    model = make(family)
    unique = dict(model.named_parameters())  # a tied weight once
    ref_norm = torch.cat([ref_grads[n].flatten() for n in unique]).norm()
    sch = slapo.create_schedule(model, group=mesh["tp"] if tp > 1 else None)
    if tp > 1:
        plans.PLANS[family](sch, tp, **({"vocab_parallel": False} if family == "gpt2" else {}))
    specs = {n: get_shard_spec(p) for n, p in sch.mod.named_parameters(remove_duplicate=False)}
    sch[CUTS[(family, 2)][0]].cut_pipeline_stage()
    ids, labels = data()
    rows = len(ids) // dp
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    engine, _ = slapo.build(
        sch,
        target="pipeline",
        schedule="1F1B",
        num_microbatches=MICRO,
        loss_fn=loss_fn,
        example_inputs=ids[mine],
        group=mesh,
        data_parallel=data_parallel,
    )
    assert engine.dp_size == dp and engine.data_parallel == data_parallel
    loss = engine.step(ids[mine], target=labels[mine])
    torch.testing.assert_close(loss, ref_loss, **TOL)

    def want(name: str) -> torch.Tensor:
        spec = specs[name]
        return ref_grads[name] if spec is None else spec.local_slice(ref_grads[name])

    def grad(p: torch.Tensor) -> torch.Tensor:  # FSDP2: gathered from the replicas' shards
        return p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad

    sharded = 0
    for name, p in engine.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        sharded += hasattr(p.grad, "full_tensor")
        torch.testing.assert_close(grad(p), want(name), **TOL, msg=lambda m, n=name: n + m)
    assert (sharded > 0) == (data_parallel == "fsdp")
    engine.step(ids[mine], target=labels[mine])  # accumulates: twice the gradient
    for name, p in engine.named_parameters():
        torch.testing.assert_close(grad(p), 2 * want(name), **TOL, msg=lambda m, n=name: n + m)
    norm = engine.clip_grad_norm_(1e-3)
    torch.testing.assert_close(norm, 2 * ref_norm, rtol=1e-5, atol=0)
    scale = 1e-3 / (2 * ref_norm + 1e-6)
    for name, p in engine.named_parameters():
        torch.testing.assert_close(grad(p), 2 * scale * want(name), **TOL)


def check_grad_scaler(world: int, data_parallel: str) -> None:
    """Loss scaling on dp 2 x 2 stages: the step reports the unscaled loss, unscaled gradients
    are the single process's, and an inf on one rank makes every rank skip the step and halve
    its scale (the inf checks agree over the world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = init_device_mesh("cpu", (world // 2, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    ref_loss, ref_grads = reference("gpt2", micro=world // 2 * MICRO)
    sch = slapo.create_schedule(make("gpt2"))
    sch[CUTS[("gpt2", 2)][0]].cut_pipeline_stage()
    ids, labels = data()
    rows = len(ids) // mesh["dp"].size()
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    with pytest.raises(TargetError, match="ShardedGradScaler"):
        slapo.build(sch, target="pipeline", num_microbatches=MICRO, loss_fn=loss_fn,
                    group=mesh, grad_scaler=torch.amp.GradScaler("cpu"))  # fmt: skip
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    engine, opt = slapo.build(
        sch, target="pipeline", num_microbatches=MICRO, loss_fn=loss_fn, group=mesh,
        example_inputs=ids[mine], optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
        data_parallel=data_parallel, grad_scaler=scaler,
    )  # fmt: skip
    torch.testing.assert_close(engine.step(ids[mine], target=labels[mine]), ref_loss, **TOL)
    scaler.unscale_(opt)
    for name, p in engine.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m, n=name: n + m)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert scaler.get_scale() == 1024.0
    engine.step(ids[mine], target=labels[mine])
    if dist.get_rank() == world - 1:  # one rank's gradient overflows
        grad = next(p.grad for p in engine.parameters() if p.grad is not None)
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")

    def local(t: torch.Tensor) -> torch.Tensor:  # (DTensor comparisons are collectives)
        return t.detach().to_local() if hasattr(t, "to_local") else t.detach()

    before = [local(p).clone() for p in engine.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all([torch.equal(a, local(b)) for a, b in zip(before, engine.parameters())])
    assert scaler.get_scale() == 512.0


def check_all_params_covered(world: int) -> None:
    """Every parameter of the model is on some stage, under its own name; the table lists them."""
    import torch.distributed as dist

    engine, opt = build("gpt2", world, "1F1B")
    mine = [n for n, _ in engine.named_parameters()]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    held = set().union(*map(set, everyone))
    model_names = {n for n, _ in make("gpt2").named_parameters(remove_duplicate=False)}
    assert held == model_names, held ^ model_names
    assert len(engine.table) == world and sum(r.params for r in engine.table) > 0
    assert "transformer.h.0" in engine.table[0 if world == 2 else 1].layers
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in engine.parameters()
    }


def check_training_keeps_ties() -> None:
    """After optimizer steps, the two copies of GPT-2's tied embedding stay equal."""
    import torch.distributed as dist

    engine, opt = build("gpt2", 2, "GPipe")
    ids, labels = data()
    for _ in range(2):
        opt.zero_grad()
        engine.step(ids, target=labels)
        opt.step()
    params = dict(engine.named_parameters())
    mine = params.get("transformer.wte.weight", params.get("lm_head.weight"))
    both: list = [None] * 2
    dist.all_gather_object(both, mine.detach())
    # Exact: both copies start equal and get the same all-reduced gradient (a two-term sum is
    # commutative) and the same optimizer arithmetic, so they stay bit-equal.
    torch.testing.assert_close(both[0], both[1], rtol=0, atol=0)


def expect(exc_type, text: str, fn) -> None:
    try:
        fn()
    except exc_type as exc:
        assert text in str(exc), f"{text!r} not in: {exc}"
    else:
        raise AssertionError(f"no {exc_type.__name__} mentioning {text!r}")


def check_bad_input(world: int) -> None:
    expect(
        TargetError,
        "more stages than",
        lambda: build("gpt2", world * 2, "1F1B", CUTS[("gpt2", 4)]),
    )
    sch = slapo.create_schedule(make("gpt2"))
    sch["transformer.h.0"].cut_pipeline_stage()
    expect(
        TargetError,
        "num_microbatches=3",
        lambda: slapo.build(
            sch, target="pipeline", num_microbatches=3, loss_fn=loss_fn, example_inputs=data()[0]
        ),
    )
    # Without example_inputs the stages wait for the first batch (jobs_lazy.py checks that path).
    lazy, _ = slapo.build(sch, target="pipeline", num_microbatches=2, loss_fn=loss_fn)
    assert not lazy.built
    expect(TargetError, "loss_fn", lambda: slapo.build(sch, target="pipeline", num_microbatches=2))
    expect(
        TargetError,
        "Nope",
        lambda: slapo.build(
            sch,
            target="pipeline",
            schedule="Nope",
            num_microbatches=2,
            loss_fn=loss_fn,
            example_inputs=data()[0],
        ),
    )

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(self.a(x)))

    toy = slapo.create_schedule(Twice())
    toy["a"].cut_pipeline_stage()
    expect(
        TargetError,
        '"a" runs 2 times',
        lambda: slapo.build(
            toy,
            target="pipeline",
            num_microbatches=2,
            loss_fn=F.mse_loss,
            example_inputs=torch.randn(4, 4),
        ),
    )


def check_stage_failure(rank: int, world: int, pg_timeout: float) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    sch = slapo.create_schedule(model)
    for i in range(world - 1):
        sch[str(i)].cut_pipeline_stage()
    engine, _ = slapo.build(
        sch,
        target="pipeline",
        schedule="1F1B",
        num_microbatches=world,
        loss_fn=F.mse_loss,
        example_inputs=torch.randn(4, 4),
        timeout=30,
    )
    last = engine.stage_modules.get(world - 1)
    if last is not None:  # make the last stage's layer raise
        layer = last.get_submodule(str(world - 1))
        layer.register_forward_pre_hook(
            lambda *_: (_ for _ in ()).throw(ValueError("boom in the last stage"))
        )
    start = time.monotonic()
    expect(
        PipelineError,
        "boom in the last stage",
        lambda: engine.step(torch.randn(4, 4), target=torch.randn(4, 4)),
    )
    # Every rank fails with the stage's error. A rank that only woke at the gloo group's
    # timeout (a failure that did not reach it) would take longer than that timeout: this is a
    # bound on a hang, not a speed measurement.
    assert time.monotonic() - start < pg_timeout / 2, "a rank waited for the group's timeout"


def build_checkpointed(ckpts: dict, schedule: str = "GPipe"):
    """2 stages of gpt2 with ``ckpts`` (path -> policy) checkpointed in the schedule."""
    sch = slapo.create_schedule(make("gpt2"))
    for path, policy in ckpts.items():
        sch[path].checkpoint(policy=policy)
    sch[CUTS[("gpt2", 2)][0]].cut_pipeline_stage()
    return slapo.build(
        sch, target="pipeline", schedule=schedule, num_microbatches=MICRO, loss_fn=loss_fn,
        example_inputs=data()[0],
    )  # fmt: skip


def saved_peak(engine, steps: int = 1) -> tuple[int, list[int]]:
    """The most bytes saved for backward alive at once on this rank over ``steps`` steps, and
    the bytes still alive after each step (gradients zeroed in between)."""
    import gc

    from slapo.memory import LiveSaved

    ids, labels = data()
    # the parameters and the batch are held by the caller anyway: not counted
    held = [*engine.parameters(), ids, labels]
    live, after = LiveSaved(skip={t.untyped_storage().data_ptr() for t in held}), []
    for _ in range(steps):
        with live:
            engine.step(ids, target=labels)
        for p in engine.parameters():
            p.grad = None
        gc.collect()
        after.append(live.now)
    return live.peak, after


def check_stage_checkpoints() -> None:
    """Checkpointed blocks survive the split: every stage saves less for backward than without
    them, and loss and gradients stay the single process's."""
    ckpts = {"transformer.h.0": None, "transformer.h.1": "save_matmuls"}
    ref_loss, ref_grads = reference("gpt2")
    engine, _ = build_checkpointed(ckpts)
    ids, labels = data()
    torch.testing.assert_close(engine.step(ids, target=labels), ref_loss, **TOL)
    for name, p in engine.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad, ref_grads[name], **TOL, msg=lambda m, n=name: n + m)
    with_ckpt, _ = saved_peak(engine)
    without, _ = saved_peak(build_checkpointed({})[0])
    assert with_ckpt < without, (with_ckpt, without)


def check_first_stage_holds_nothing() -> None:
    """Between steps stage 0 holds no bytes saved for backward: it no longer keeps the first
    step's shape-inference forward (the stages get their shapes at build)."""
    engine, _ = build_checkpointed({})
    _, after = saved_peak(engine, steps=2)
    if engine.is_first:
        assert after == [0, 0], after
    else:  # the last stage's receive buffers (saved by its first ops) are reused, not grown
        assert after[0] == after[1], after


def pp2_checks(rank: int, world: int, pg_timeout: float) -> dict:
    """Checks of the 2-rank job; the failing stage goes last since it breaks the group's links."""
    return {
        "gpt2_gpipe": lambda: check_equivalence("gpt2", 2, "GPipe"),
        "gpt2_1f1b": lambda: check_equivalence("gpt2", 2, "1F1B"),
        "llama_gpipe": lambda: check_equivalence("llama", 2, "GPipe"),
        "llama_1f1b": lambda: check_equivalence("llama", 2, "1F1B"),
        # Two stages per rank, and stage 0 hands values on to stages 2 and 3.
        "gpt2_interleaved": lambda: check_equivalence(
            "gpt2", 4, "Interleaved1F1B", GPT2_AT_DROP, micro=4
        ),
        "params_and_table": lambda: check_all_params_covered(world),
        "ties_stay_equal": check_training_keeps_ties,
        "stage_checkpoints": check_stage_checkpoints,
        "first_stage_holds_nothing": check_first_stage_holds_nothing,
        "bad_input": lambda: check_bad_input(world),
        "stage_failure": lambda: check_stage_failure(rank, world, pg_timeout),
    }


def pp4_checks(rank: int, world: int, pg_timeout: float) -> dict:
    """Checks of the 4-rank job; the failing stage goes last."""
    return {
        "gpt2_gpipe": lambda: check_equivalence("gpt2", 4, "GPipe"),
        "gpt2_1f1b": lambda: check_equivalence("gpt2", 4, "1F1B", micro=4),
        "gpt2_cut_at_drop": lambda: check_equivalence("gpt2", 4, "GPipe", GPT2_AT_DROP),
        "llama_gpipe": lambda: check_equivalence("llama", 4, "GPipe"),
        "llama_1f1b": lambda: check_equivalence("llama", 4, "1F1B", micro=4),
        "pp_x_tp_gpt2": lambda: check_pp_tp("gpt2", world),
        "pp_x_tp_llama": lambda: check_pp_tp("llama", world),
        "dp_x_pp_gpt2": lambda: check_dp_pp_tp("gpt2", world, tp=1),
        "dp_x_pp_llama": lambda: check_dp_pp_tp("llama", world, tp=1),
        "dp_x_pp_gpt2_fsdp": lambda: check_dp_pp_tp("gpt2", world, tp=1, data_parallel="fsdp"),
        "grad_scaler_ddp": lambda: check_grad_scaler(world, "ddp"),
        "grad_scaler_fsdp": lambda: check_grad_scaler(world, "fsdp"),
        "stage_failure": lambda: check_stage_failure(rank, world, pg_timeout),
    }


def pp8_checks(rank: int, world: int, pg_timeout: float) -> dict:
    """Checks of the 8-rank job: dp 2 x pp 2 x tp 2."""
    return {
        "dp_pp_tp_gpt2": lambda: check_dp_pp_tp("gpt2", world, tp=2),
        "dp_pp_tp_llama": lambda: check_dp_pp_tp("llama", world, tp=2),
        "dp_pp_tp_gpt2_fsdp": lambda: check_dp_pp_tp("gpt2", world, tp=2, data_parallel="fsdp"),
    }
