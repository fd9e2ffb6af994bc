"""Expert parallelism inside pipeline stages (spawned gloo workers): one process is the oracle.

4 ranks on an ("ep", "pp") mesh: two pipelines of two stages; the ranks holding the same stage
form an expert-parallel group. Each pipeline trains on its half of the global batch. The checks
run in the suite's shared 4-rank job (``conftest.py``, ``target_jobs.py``).
"""

from __future__ import annotations

import copy

import ep_jobs
import torch
from torch.distributed.device_mesh import init_device_mesh

import slapo
from slapo.sharding.expert_grads import reduce_expert_grads
from slapo.sharding.expert_parallel import expert_parallel, is_expert_parameter
from slapo.train.presets import causal_lm_loss

MICRO = 2
HALF = 2  # sequences per pipeline replica
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _half(ids: torch.Tensor, replica: int) -> torch.Tensor:
    return ids[replica * HALF : (replica + 1) * HALF]


def _reference(ref: torch.nn.Module, half: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One process: the mean microbatch loss of ``half`` and its gradient by parameter name."""
    ref.zero_grad(set_to_none=True)
    loss = torch.stack(
        [causal_lm_loss(ref(input_ids=mb).logits, mb) for mb in half.chunk(MICRO)]
    ).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def check_ep_x_pp(family: str) -> None:
    """Each replica's loss is one process's on its half; a local expert's gradient is the slice
    of the one-process gradient of both halves' losses summed (its owner gets every replica's
    tokens); every other stage parameter's gradient is its own half's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "pp"))
    replica = mesh["ep"].get_local_rank()
    ids = torch.randint(
        1, ep_jobs.VOCAB, (2 * HALF, ep_jobs.SEQ), generator=torch.Generator().manual_seed(5)
    )
    ref = ep_jobs.tiny(family, aux=False)
    model = copy.deepcopy(ref)
    refs = [_reference(ref, _half(ids, r)) for r in range(2)]
    ref_loss, own = refs[replica]

    expert_parallel(model, mesh["ep"])
    sch = slapo.create_schedule(model)
    sch["model.layers.0"].cut_pipeline_stage()
    mine = _half(ids, replica)
    engine, _ = slapo.build(
        sch,
        target="pipeline",
        schedule="1F1B",
        num_microbatches=MICRO,
        loss_fn=causal_lm_loss,
        example_inputs=mine,
        group=mesh,
    )
    ops = [
        n
        for stage in engine.stage_modules.values()
        for mod in stage.modules()  # the split stage nests a graph per traced submodule
        if isinstance(getattr(mod, "graph", None), torch.fx.Graph)
        for n in mod.graph.nodes
        if n.target is torch.ops.slapo_pipeline.expert_dispatch.default
    ]
    assert len(ops) == 1, f"one MoE layer per stage, got {len(ops)} dispatch nodes"
    loss = engine.step(mine, target=mine)
    torch.testing.assert_close(loss, ref_loss, **TOL)

    experts = 0
    for name, p in engine.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        if is_expert_parameter(model, name):
            experts += 1
            local = model.get_submodule(name.rpartition(".")[0])
            cut = slice(local.first, local.first + local.num_local)
            want = (refs[0][1][name] + refs[1][1][name])[cut]
        else:
            want = own[name]
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name: n + m)
    assert experts == 2, f"expected the stage's gate_up_proj and down_proj, got {experts}"


def check_dp_ep_pp_and_clip() -> None:
    """ep borrowed from dp, as ``slapo train --ep 2 --pp 2`` lays it out: on a ("dp", "pp")
    mesh the replicas average the replicated gradients, the experts' hooks average theirs
    (reduce_expert_grads), so every stage gradient is the one-process gradient of the mean of
    both halves' losses; clip_grad_norm_ returns that gradient's whole-model norm (expert slices
    summed over the ep group) and clips to it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh["dp"].get_local_rank()
    ids = torch.randint(
        1, ep_jobs.VOCAB, (2 * HALF, ep_jobs.SEQ), generator=torch.Generator().manual_seed(7)
    )
    ref = ep_jobs.tiny("qwen3_moe", aux=False)
    model = copy.deepcopy(ref)
    refs = [_reference(ref, _half(ids, r)) for r in range(2)]
    mean = {n: (refs[0][1][n] + refs[1][1][n]) / 2 for n in refs[0][1]}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean.values()]))

    expert_parallel(model, mesh["dp"])
    reduce_expert_grads(model, replicas=None, average_over=2)
    sch = slapo.create_schedule(model)
    sch["model.layers.0"].cut_pipeline_stage()
    mine = _half(ids, replica)
    engine, _ = slapo.build(
        sch, target="pipeline", schedule="1F1B", num_microbatches=MICRO,
        loss_fn=causal_lm_loss, example_inputs=mine, group=mesh, data_parallel="ddp",
    )  # fmt: skip
    engine.step(mine, target=mine)
    for name, p in engine.named_parameters():
        want = mean[name]
        if is_expert_parameter(model, name):
            local = model.get_submodule(name.rpartition(".")[0])
            want = want[local.first : local.first + local.num_local]
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name: n + m)
    total = engine.clip_grad_norm_(float(norm) / 2)
    torch.testing.assert_close(total, norm.float(), rtol=1e-5, atol=0)
    name, p = next(iter(engine.named_parameters()))
    torch.testing.assert_close(p.grad, want_half(mean[name], model, name), **TOL)


def want_half(full: torch.Tensor, model: torch.nn.Module, name: str) -> torch.Tensor:
    """Half of ``full`` (clipped to half the norm), sliced as this rank holds it."""
    if is_expert_parameter(model, name):
        local = model.get_submodule(name.rpartition(".")[0])
        full = full[local.first : local.first + local.num_local]
    return full / 2


def pp_ep_checks() -> dict:
    """Checks of the suite's 4-rank job (target_jobs.job4)."""
    checks = {f"ep_x_pp_{f}": lambda f=f: check_ep_x_pp(f) for f in ("qwen3_moe", "mixtral")}
    return {**checks, "dp_ep_pp_clip": check_dp_ep_pp_and_clip}
