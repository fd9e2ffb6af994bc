"""The step-time model's counts against plain PyTorch (slapo.plan.step_time).

The FLOPs the fake step counts must be those ``torch.utils.flop_counter.FlopCounterMode`` counts
over the same training step run for real (recompute of checkpointed blocks included); the
seconds follow from the counts by the stated formulas.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import slapo
from slapo.memory import estimate_memory
from slapo.plan.hardware import PRESETS, ClusterSpec
from slapo.plan.step_time import (
    PlanError,
    StepCounter,
    StepCounts,
    _attention_flops,
    predict_step,
    shape_key,
)

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # attention as matmuls: FlopCounterMode counts them
    return transformers.LlamaForCausalLM(cfg)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _real_flops(module: torch.nn.Module, batch: dict) -> int:
    with FlopCounterMode(display=False) as real:
        module(**batch).loss.backward()
    return real.get_total_flops()


def _fake_matmul_flops(sch, batch: dict) -> StepCounter:
    with StepCounter() as counter:
        estimate_memory(sch, batch)
    return counter


@pytest.mark.parametrize("checkpointed", [False, True])
def test_fake_step_flops_equal_a_real_steps(checkpointed: bool) -> None:
    model = _llama()
    sch = slapo.create_schedule(model)
    if checkpointed:  # the backward recomputes the block: its forward FLOPs count twice
        sch["model.layers.0"].checkpoint()
    counter = _fake_matmul_flops(sch, _batch())
    fake = sum(n for (phase, _), n in counter.flops.items() if phase != "optimizer")
    assert fake == _real_flops(sch.mod, _batch())
    assert counter.memory_bytes["optimizer"] > 0  # AdamW's step is memory-bound work


def test_checkpoint_adds_the_blocks_forward_to_backward() -> None:
    plain = _fake_matmul_flops(slapo.create_schedule(_llama()), _batch())
    sch = slapo.create_schedule(_llama())
    sch["model.layers.0"].checkpoint()
    ckpt = _fake_matmul_flops(sch, _batch())
    assert ckpt.flops[("forward", "matmul")] == plain.flops[("forward", "matmul")]
    assert ckpt.flops[("backward", "matmul")] > plain.flops[("backward", "matmul")]


def test_attention_flops_are_flop_counters_halved_when_causal() -> None:
    q = torch.empty(2, 4, 32, 16, device="meta")
    k = v = torch.empty(2, 4, 32, 16, device="meta")
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    full = sdpa_flop_count(q.shape, k.shape, v.shape)
    assert _attention_flops(op, (q, k, v, 0.0, False), {}, backward=False) == full
    assert _attention_flops(op, (q, k, v, 0.0, True), {}, backward=False) == full // 2


def _cluster() -> ClusterSpec:
    return ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)


def test_fsdp_collectives_overlap_and_dp1_moves_nothing() -> None:
    sch = slapo.create_schedule(_llama())
    one = predict_step(sch, _batch(), _cluster(), target="fsdp", dp=1)
    assert one.counts["hidden_collective_seconds"] == {}
    sixteen = predict_step(sch, _batch(), _cluster(), target="fsdp", dp=16)
    hidden = sixteen.counts["hidden_collective_seconds"]
    exposed = sixteen.time_terms["fsdp all-gather (exposed)"]
    assert 0 < exposed < hidden["fsdp all-gather x2"] / 2
    assert sixteen.tokens_per_s_per_gpu > 0 and 0 < sixteen.mfu < 1
    ddp = predict_step(sch, _batch(), _cluster(), target="ddp", dp=16)
    assert 0 < ddp.time_terms["ddp all-reduce (exposed)"] <= ddp.counts[
        "hidden_collective_seconds"]["ddp all-reduce"]  # fmt: skip


def test_pipeline_bubble_is_the_schedules() -> None:
    sch = slapo.create_schedule(_llama())
    sch["model.layers.1"].cut_pipeline_stage()
    pp, m = 2, 2
    pred = predict_step(
        sch, _batch(), _cluster(), target="pipeline", pp=pp, num_microbatches=m,
        precision="fp32",
    )  # fmt: skip
    compute = sum(v for k, v in pred.time_terms.items() if "(forward)" in k or "(backward)" in k)
    assert pred.time_terms["pipeline bubble"] == pytest.approx(compute * (pp - 1) / m)


def test_no_tokens_is_a_typed_error() -> None:
    with pytest.raises(PlanError, match="no tensor"):
        from slapo.plan.step_time import _tokens

        _tokens({"x": 1})


def test_tensor_parallel_all_reduces_are_counted_from_the_step() -> None:
    from slapo.memory import fake_process_group
    from slapo.model_schedule import apply_schedule

    model, batch = _llama(), _batch()
    with fake_process_group(2, rank=0) as group:
        sch = apply_schedule(model, group=group)
        pred = predict_step(sch, batch, _cluster(), target="fsdp", dp=2, tp=2, precision="fp32")
    # Megatron's two all-reduces per layer in forward (attention, MLP) of tokens x hidden
    # float32; a ring of 2 sends each all-reduce's size once
    tokens, hidden, layers = batch["input_ids"].numel(), 64, 2
    assert (
        pred.counts["collectives"][("forward", "allreduce_", 2)] == 2 * layers * tokens * hidden * 4
    )
    assert pred.time_terms["allreduce_ x2 (forward)"] > 0


def test_a_cluster_that_is_not_one_is_a_typed_error() -> None:
    with pytest.raises(PlanError, match="ClusterSpec"):
        predict_step(slapo.create_schedule(_llama()), _batch(), PRESETS["h100-sxm"], dp=2)


def test_shape_keys_name_each_gemm_and_attention_kernel() -> None:
    a, b, bias = torch.ones(64, 32), torch.ones(32, 16), torch.ones(16)
    aten = torch.ops.aten
    assert shape_key(aten.mm.default, (a, b), {}) == "matmul fp32 64x16x32 nn"
    assert shape_key(aten.addmm.default, (bias, a, b), {}) == "matmul fp32 64x16x32 nn"
    # a linear's forward multiplies by its weight transposed
    weight = torch.ones(16, 32)
    assert shape_key(aten.addmm.default, (bias, a, weight.t()), {}) == "matmul fp32 64x16x32 nt"
    batched = (torch.ones(3, 64, 32, dtype=torch.bfloat16), torch.ones(3, 32, 8))
    assert shape_key(aten.bmm.default, batched, {}) == "matmul bf16 3x64x8x32 nn"
    q, k = torch.ones(2, 4, 32, 16), torch.ones(2, 4, 24, 16)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert shape_key(sdpa, (q, k, k, 0.0, True), {}) == "attention fwd fp32 8x32x24x16 causal"
    assert shape_key(aten.add.Tensor, (a, a), {}) is None  # memory-bound: no per-shape rate


def test_shaped_flops_are_every_matmul_and_attention_flop() -> None:
    model = _llama()
    model.config._attn_implementation = "sdpa"
    counter = _fake_matmul_flops(slapo.create_schedule(model), _batch())
    for kind in ("matmul", "attention"):
        by_shape = sum(n for (_, key), n in counter.shaped_flops.items() if key.startswith(kind))
        assert by_shape == sum(n for (_, k), n in counter.flops.items() if k == kind) > 0
    keys = {key for _, key in counter.shaped_flops}
    # the MLP's up projection forward (2 x 16 tokens, 64 -> 128), its weight's gradient
    assert {"matmul fp32 32x128x64 nt", "matmul fp32 128x64x32 tn"} <= keys


def _cpu(threads: int, ranks: int = 1, **device) -> ClusterSpec:
    dev = dataclasses.replace(PRESETS["h100-sxm"], **device)
    return ClusterSpec(dev, gpus_per_node=ranks, shared_cores=2, threads_per_rank=threads)


def test_a_measured_shape_runs_at_its_own_rate() -> None:
    model = _llama()
    model.config._attn_implementation = "sdpa"
    sch = slapo.create_schedule(model)
    counter = _fake_matmul_flops(sch, _batch())
    counts = StepCounts.of(counter)
    plain = predict_step(sch, _batch(), _cpu(2), target="eager", precision="fp32")
    # every matmul shape measured at a tenth of the generic fp32 rate, at 2 threads
    rate = PRESETS["h100-sxm"].achievable_tflops("matmul", "tf32") / 10
    table = {f"{k} @2t": rate for k in counts.shapes() if k.startswith("matmul")}
    slow = predict_step(sch, _batch(), _cpu(2, op_tflops=table), target="eager", precision="fp32")
    for phase in ("forward", "backward"):
        assert slow.time_terms[f"matmul ({phase})"] == pytest.approx(
            10 * plain.time_terms[f"matmul ({phase})"]
        )
        assert slow.time_terms[f"attention ({phase})"] == plain.time_terms[f"attention ({phase})"]
    # a rate measured at another thread count does not apply
    other = predict_step(sch, _batch(), _cpu(1, op_tflops=table), target="eager", precision="fp32")
    one_thread = predict_step(sch, _batch(), _cpu(1), target="eager", precision="fp32")
    assert other.time_terms["matmul (forward)"] == one_thread.time_terms["matmul (forward)"]
    # eight one-thread ranks on two cores: each computes at the rate measured at one thread,
    # and they take turns: the step is their work over the cores, four times one rank's
    one = {k.replace("@2t", "@1t"): v for k, v in table.items()}
    alone = predict_step(sch, _batch(), _cpu(1, 2, op_tflops=one), target="ddp", dp=2)
    eight = _cpu(1, 8, op_tflops=one)
    crowded = predict_step(sch, _batch(), eight, target="ddp", dp=8)
    assert crowded.time_terms["matmul (forward)"] == alone.time_terms["matmul (forward)"]
    own_cores = predict_step(
        sch, _batch(), dataclasses.replace(eight, time_shared=False), target="ddp", dp=8
    )  # fmt: skip
    assert crowded.seconds == pytest.approx(4 * own_cores.seconds)
    assert crowded.time_terms["8 ranks taking turns on the cores"] == pytest.approx(
        3 * own_cores.seconds
    )
    assert crowded.tokens_per_s_per_gpu == pytest.approx(own_cores.tokens_per_s_per_gpu / 4)


def test_a_calibrated_fsdp_unit_replaces_its_collectives_latency() -> None:
    sch = slapo.create_schedule(_llama())  # 2 layers: 3 FSDP units
    cpu = dict(op_overhead_us=0.0)
    plain = predict_step(sch, _batch(), _cpu(1, 2, **cpu), target="fsdp", dp=2)
    unit = _cpu(1, 2, engine_overhead_us={"fsdp_unit": 1000.0}, **cpu)
    timed = predict_step(sch, _batch(), unit, target="fsdp", dp=2)
    assert timed.time_terms["fsdp hooks, copies, latency"] == pytest.approx(3 * 1000e-6)
    assert "fsdp hooks, copies, latency" not in plain.time_terms
    # the unit's figure holds its collectives' latency: they keep their bytes only
    hidden = timed.counts["hidden_collective_seconds"]["fsdp reduce-scatter"]
    assert hidden < plain.counts["hidden_collective_seconds"]["fsdp reduce-scatter"]
    eight = dataclasses.replace(unit, gpus_per_node=8)  # eight ranks' hooks on two cores
    crowded = predict_step(sch, _batch(), eight, target="fsdp", dp=8)
    assert crowded.time_terms["fsdp hooks, copies, latency"] == pytest.approx(3 * 1000e-6)
    assert crowded.time_terms["8 ranks taking turns on the cores"] > 3 * 3 * 1000e-6


def _checkpointed(policy: str | None) -> slapo.Schedule:
    sch = slapo.create_schedule(_llama())
    for i in range(2):
        sch[f"model.layers.{i}"].checkpoint(policy=policy)
    return sch


def _ops_in_a_block() -> int:
    """Ops (views too) one decoder block dispatches in forward, real tensors, no checkpoint."""

    class Every(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += func.namespace != "prim" and func is not torch.ops.aten.detach.default
            return func(*args, **(kwargs or {}))

    model = _llama()
    block = model.model.layers[0]
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    positions = model.model.rotary_emb(hidden, torch.arange(16)[None])
    with Every() as every:
        block(hidden, position_embeddings=positions)
    return every.ops


def test_ops_through_a_selective_checkpoint_are_counted() -> None:
    for sch in (slapo.create_schedule(_llama()), _checkpointed(None)):  # no dispatch mode
        assert _fake_matmul_flops(sch, _batch()).selective_ops == {}
    counter = _fake_matmul_flops(_checkpointed("save_matmuls"), _batch())
    # every op of both blocks' forward passes through the caching mode (in the model, one more:
    # the causal mask's add, which the block called alone has no mask for); the recompute's
    # in backward through the replaying one
    block = _ops_in_a_block()
    assert 2 * block <= counter.selective_ops["forward"] <= 2 * (block + 1)
    assert counter.selective_ops["backward"] > 0
    assert "optimizer" not in counter.selective_ops


def test_a_selective_checkpoint_costs_its_dispatch_uncompiled() -> None:
    sch = _checkpointed("save_matmuls")
    cpu = _cpu(1, engine_overhead_us={"sac_op": 10.0})
    pred = predict_step(sch, _batch(), cpu, target="eager", precision="fp32")
    for phase, ops in pred.counts["selective_ops"].items():
        term = pred.time_terms[f"selective checkpoint dispatch ({phase})"]
        assert term == pytest.approx(ops * 10e-6)
    compiled = predict_step(sch, _batch(), cpu, target="eager", precision="fp32", compile=True)
    assert not any(k.startswith("selective checkpoint") for k in compiled.time_terms)


def test_a_measured_collective_call_replaces_the_links_figure() -> None:
    from slapo.memory import fake_process_group
    from slapo.model_schedule import apply_schedule
    from slapo.plan.step_time import collective_key

    with fake_process_group(2, rank=0) as group:
        sch = apply_schedule(_llama(), group=group)
        plain = predict_step(sch, _batch(), _cluster(), target="ddp", dp=1, tp=2, precision="fp32")
        # a forward all-reduce: the batch's tokens x hidden, float32, over the 2 tp ranks
        key = collective_key("allreduce_", 2, 2 * 16 * 64 * 4)
        assert key == "all_reduce 8192B x2" and key in plain.counts["collective_keys"]
        dev = dataclasses.replace(_cluster().device, collective_us={key: 500.0})
        timed = predict_step(
            sch, _batch(), dataclasses.replace(_cluster(), device=dev), target="ddp", dp=1, tp=2,
            precision="fp32",
        )  # fmt: skip
    calls = plain.counts["collectives"][("forward", "allreduce_", 2)] // 8192  # a ring of 2
    assert timed.time_terms["allreduce_ x2 (forward)"] == pytest.approx(calls * 500e-6)
    assert plain.time_terms["allreduce_ x2 (forward)"] < calls * 500e-6


def test_a_pipelines_idle_ranks_give_their_turn_to_others() -> None:
    sch = slapo.create_schedule(_llama(4))
    sch["model.layers.2"].cut_pipeline_stage()
    batch = _batch()
    cpu = _cpu(1, 4)
    shared = predict_step(sch, batch, cpu, target="ddp", dp=2, pp=2, num_microbatches=2,
                          precision="fp32")  # fmt: skip
    alone = predict_step(sch, batch, dataclasses.replace(cpu, time_shared=False),
                         target="ddp", dp=2, pp=2, num_microbatches=2, precision="fp32")  # fmt: skip
    # four one-thread ranks on two cores: twice the busy part of a rank (not its bubble)
    busy = alone.seconds - alone.time_terms["pipeline bubble"]
    assert shared.seconds == pytest.approx(max(alone.seconds, 2 * busy))
