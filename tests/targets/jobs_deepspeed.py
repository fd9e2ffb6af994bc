"""DeepSpeed jobs (spawned gloo workers): plain PyTorch in one process is the oracle of each check.

Every check trains with the contract's one loop (``jobs_loop.loop``: ``slapo.train_step``,
``optimizer.step()``, ``optimizer.zero_grad()``) and compares the loss curve and the parameters
after 3 steps with the one-process loop on the whole batch; the pipeline checks compare the
gradients of the first step as well. Tolerances are float32 ``assert_close``: ranks, microbatches
and all-reduces sum in another order than one pass.
"""

from __future__ import annotations

import jobs_loop
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_models
import slapo
from dist_utils import run_checks
from slapo.exceptions import TargetError
from slapo.targets.deepspeed import named_parameters

STEPS = 3
BATCH = 4
# SGD with momentum, not Adam: Adam divides by sqrt of tiny second moments (attention key biases
# get ~0 gradients), which turns summation-order noise into large parameter differences.
OPT = {"lr": 0.1, "momentum": 0.9}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, hf_models.VOCAB, (BATCH, hf_models.SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The models' own loss from the last stage's logits: token t predicts label t + 1."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten())


def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The plain loop on the whole batch: its losses, its first step's gradients (every name of
    every parameter) and its parameters after the last step."""
    model = hf_models.make(family, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), **OPT)
    losses, grads = [], {}
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        if not grads:
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, params


def slices(index: int, parts: int) -> list[dict[str, torch.Tensor]]:
    """Data-parallel replica ``index`` of ``parts``: its contiguous slice of every batch."""
    per = BATCH // parts
    return [{k: v[index * per : (index + 1) * per] for k, v in b.items()} for b in batches()]


def mean_over(losses: list[float], group=None) -> list[float]:
    """Equal slices: the mean of the replicas' losses is the whole batch's."""
    t = torch.tensor(losses)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def gathered(engine):
    """Every parameter of this rank whole (ZeRO-3 partitions them) under its model name."""
    import deepspeed

    params = dict(named_parameters(engine))
    return deepspeed.zero.GatheredParameters(list(params.values())), params


def assert_params(engine, want: dict[str, torch.Tensor]) -> None:
    ctx, params = gathered(engine)
    with ctx:
        assert set(params) <= set(want) and params, set(params) - set(want)
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), want[name], **TOL, msg=lambda m, n=name: n + m)


def logits_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """A ``loss_fn`` of the model's output: the causal loss of its logits."""
    return causal_loss(out.logits, labels)


# ----- ZeRO over every rank ----------------------------------------------------------------------
def check_zero(stage: int, family: str, rank: int, world: int, loss_fn=None) -> None:
    ref_losses, _, ref_params = reference(family)
    sch = slapo.create_schedule(hf_models.make(family, dropout=0.0))
    engine, opt = slapo.build(
        sch,
        target="deepspeed",
        zero_stage=stage,
        micro_batch_size=BATCH // world,
        loss_fn=loss_fn,
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    assert engine.zero_optimization_stage() == stage
    losses = mean_over(jobs_loop.loop(engine, opt, slices(rank, world)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert_params(engine, ref_params)
    assert {n for n, _ in named_parameters(engine)} == set(dict(sch.mod.named_parameters()))


def check_other_loops(rank: int, world: int) -> None:
    """The engine also trains with DeepSpeed's own loop (``engine.backward(loss);
    engine.step()``) and, where the forward returns the loss, with torch's
    (``loss.backward(); optimizer.step()``)."""
    _, _, ref_params = reference("gpt2")
    for loop in ("deepspeed", "torch"):
        sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
        engine, opt = slapo.build(
            sch, target="deepspeed", zero_stage=2, optimizer=torch.optim.SGD, optimizer_kwargs=OPT
        )
        for part in slices(rank, world):
            loss = engine(**part).loss
            if loop == "deepspeed":
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        assert_params(engine, ref_params)


# ----- DeepSpeed's pipeline engine -----------------------------------------------------------------
CUT = {"gpt2": "transformer.h.0", "llama": "model.layers.0"}


def check_pipeline(family: str, rank: int, world: int, zero_stage: int = 0) -> None:
    """2 stages (x world / 2 data-parallel pipelines): the first step's loss and gradients,
    then the loss curve and the parameters after 3 steps, equal the one-process loop's."""
    ref_losses, ref_grads, ref_params = reference(family)
    replicas = world // 2
    sch = slapo.create_schedule(hf_models.make(family, dropout=0.0))
    sch[CUT[family]].cut_pipeline_stage()
    first = slices(0, replicas)[0]["input_ids"]
    engine, opt = slapo.build(
        sch,
        target="deepspeed",
        zero_stage=zero_stage,
        loss_fn=causal_loss,
        num_microbatches=2,
        example_inputs=(first,),
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    assert type(engine).__name__ == "PipelineEngine" and engine.num_stages == 2
    data = slices(engine.grid.data_parallel_id, replicas)
    held = dict(named_parameters(engine))
    if family == "gpt2":  # the tied embedding and head: one TiedLayerSpec weight on both stages
        tied = "lm_head.weight" if engine.stage_id == 1 else "transformer.wte.weight"
        assert held[tied] is engine.module.tied_modules["lm_head__weight"].weight
    # The first step's forward and backward: the gradients of the whole batch, before the step
    # (ZeRO-1 moves them into its partitions: they are checked through the step's result).
    loss = slapo.train_step(engine, data[0])
    torch.testing.assert_close(float(loss), ref_losses[0], **TOL)
    for name, p in held.items() if zero_stage == 0 else ():
        torch.testing.assert_close(p.grad, ref_grads[name], **TOL, msg=lambda m, n=name: n + m)
    opt.step()
    opt.zero_grad()
    losses = [float(loss)] + jobs_loop.loop(engine, opt, data[1:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert_params(engine, ref_params)


def check_pipeline_bf16(rank: int, world: int) -> None:
    """DeepSpeed's bf16 mode: the stages are traced in bfloat16 (the trace checks dtypes) and
    train from about the float32 loss (bfloat16 keeps 8 bits of mantissa)."""
    ref_losses, _, _ = reference("gpt2")
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    sch[CUT["gpt2"]].cut_pipeline_stage()
    data = batches()
    engine, opt = slapo.build(
        sch,
        target="deepspeed",
        config={"bf16": {"enabled": True}},
        loss_fn=causal_loss,
        num_microbatches=2,
        example_inputs=(data[0]["input_ids"],),
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    assert {p.dtype for _, p in named_parameters(engine)} == {torch.bfloat16}
    losses = jobs_loop.loop(engine, opt, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def check_zero_bf16(rank: int, world: int) -> None:
    """``precision="bf16"`` on ZeRO-2: DeepSpeed's bf16 section, a bf16 module, float32 master
    weights (the optimizer's partition); the loss curve follows float32's within 2%."""
    ref_losses, _, _ = reference("llama")
    sch = slapo.create_schedule(hf_models.make("llama", dropout=0.0))
    engine, opt = slapo.build(
        sch, target="deepspeed", zero_stage=2, micro_batch_size=BATCH // world,
        precision="bf16", optimizer=torch.optim.SGD, optimizer_kwargs=OPT,
    )  # fmt: skip
    assert engine.bfloat16_enabled()
    assert {p.dtype for _, p in named_parameters(engine)} == {torch.bfloat16}
    masters = engine.optimizer.single_partition_of_fp32_groups
    assert masters and {t.dtype for t in masters} == {torch.float32}
    losses = mean_over(jobs_loop.loop(engine, opt, slices(rank, world)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


# ----- tensor parallel x ZeRO ------------------------------------------------------------------------
def check_tp_zero(family: str, stage: int, rank: int, world: int) -> None:
    """A 2 x 2 (dp, tp) mesh: ZeRO over "dp" of a schedule tensor parallel over "tp"; every rank
    holds its tensor shard of the one-process parameters."""
    import plans
    from torch.distributed.device_mesh import init_device_mesh

    from slapo.sharding import get_shard_spec

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    ref_losses, _, ref_params = reference(family)
    sch = slapo.create_schedule(hf_models.make(family, dropout=0.0), group=mesh["tp"])
    plans.PLANS[family](sch, world // 2)
    specs = {n: get_shard_spec(p) for n, p in sch.mod.named_parameters()}
    engine, opt = slapo.build(
        sch,
        target="deepspeed",
        zero_stage=stage,
        group=mesh["dp"],
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    assert engine.dp_world_size == 2
    dp = mesh["dp"].get_group()
    losses = mean_over(jobs_loop.loop(engine, opt, slices(mesh["dp"].get_local_rank(), 2)), dp)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    want = {
        n: ref_params[n] if spec is None else spec.local_slice(ref_params[n])
        for n, spec in specs.items()
    }
    assert_params(engine, want)


# ----- options ---------------------------------------------------------------------------------------
def check_bad_options() -> None:
    def plain():
        return slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))

    def cut():
        sch = plain()
        sch["transformer.h.0"].cut_pipeline_stage()
        return sch

    def tensor_parallel():  # the world as the tensor-parallel group
        return slapo.create_schedule(hf_models.make("gpt2", dropout=0.0), group=dist.group.WORLD)

    ids = batches()[0]["input_ids"]
    pipe = {"loss_fn": causal_loss, "num_microbatches": 2, "example_inputs": (ids,)}
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    cases = [
        (plain, {"zero_stage": 4}, "zero_stage="),
        (plain, {"group": alone}, "spans 1 of 2 ranks"),
        (tensor_parallel, {}, "group=mesh['dp']"),
        (tensor_parallel, {"group": dist.group.WORLD}, "must be the 2 ranks"),
        (cut, {**pipe, "group": alone}, "group=/mpu= with pipeline cuts"),
        (plain, {"config": 3}, "config="),
        (plain, {"num_microbatches": 2}, "has none"),
        (cut, {**pipe, "zero_stage": 2}, "ZeRO 0 or 1"),
        (cut, {**pipe, "loss_fn": None}, "loss_fn="),
        (cut, {**pipe, "example_inputs": None}, "example_inputs="),
        (cut, {**pipe, "num_microbatches": 3}, "does not divide the batch of 4"),
    ]
    for make_sch, kwargs, text in cases:
        try:
            slapo.build(make_sch(), target="deepspeed", **kwargs)
        except TargetError as exc:
            assert text in str(exc), (kwargs, exc)
        else:
            raise AssertionError(f"no TargetError for {kwargs}")


def check_pipeline_batches() -> None:
    """A batch the traced pipeline cannot take is named before any stage runs."""
    sch = slapo.create_schedule(hf_models.make("gpt2", dropout=0.0))
    sch["transformer.h.0"].cut_pipeline_stage()
    batch = batches()[0]
    engine, _ = slapo.build(
        sch,
        target="deepspeed",
        loss_fn=causal_loss,
        num_microbatches=2,
        example_inputs=(batch["input_ids"],),
        optimizer=torch.optim.SGD,
        optimizer_kwargs=OPT,
    )
    for bad, loss_fn, text in [
        ({**batch, "attention_mask": batch["labels"]}, None, "['attention_mask']"),
        ({"input_ids": batch["input_ids"]}, None, '"labels" entry'),
        ({k: v[:2] for k, v in batch.items()}, None, "traced for [(4, 12)]"),
        (batch, causal_loss, "loss_fn= there"),
    ]:
        try:
            slapo.train_step(engine, bad, loss_fn=loss_fn)
        except TargetError as exc:
            assert text in str(exc), exc
        else:
            raise AssertionError(f"no TargetError mentioning {text}")
    assert all(p.grad is None for _, p in named_parameters(engine))


# ----- the jobs ----------------------------------------------------------------------------------------
def job2(rank: int, world: int) -> dict[str, str | None]:
    return run_checks(
        {
            "zero1_gpt2": lambda: check_zero(1, "gpt2", rank, world, logits_loss),
            "zero2_llama": lambda: check_zero(2, "llama", rank, world),
            "zero3_gpt2": lambda: check_zero(3, "gpt2", rank, world),
            # before the pipeline checks: DeepSpeed's pipeline engine leaves its topology in
            # deepspeed.utils.groups, which a later ZeRO engine would read as model parallelism
            "zero2_bf16": lambda: check_zero_bf16(rank, world),
            "other_loops": lambda: check_other_loops(rank, world),
            "pipe_gpt2": lambda: check_pipeline("gpt2", rank, world),
            "pipe_llama": lambda: check_pipeline("llama", rank, world),
            "pipe_bf16": lambda: check_pipeline_bf16(rank, world),
            "bad_options": check_bad_options,
            "pipe_batches": check_pipeline_batches,
        }
    )


def job4(rank: int, world: int) -> dict[str, str | None]:
    return run_checks(
        {
            "tp_zero2_llama": lambda: check_tp_zero("llama", 2, rank, world),
            "tp_zero3_gpt2": lambda: check_tp_zero("gpt2", 3, rank, world),
            "pipe_dp_zero1_gpt2": lambda: check_pipeline("gpt2", rank, world, zero_stage=1),
        }
    )
