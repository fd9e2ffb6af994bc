"""Compiled blocks (the ``compile`` primitive, the ``compile_blocks`` knob) and selective
checkpointing in the ready schedules: the same loss and gradients as the unscheduled model, alone
and with tensor parallelism on 2 gloo ranks, and clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from compile_jobs import tp_job
from torch import nn

import hf_models as H
import slapo
from dist_utils import assert_check, check_all, run_workers
from slapo.model_schedule import CKPT_POLICIES, Knobs, apply_schedule, recommended_knobs
from slapo.op.dropout import bulk_dropout_masks
from slapo.primitives.compile import CompileError, compiled

FAMILIES = ["gpt2", "llama", "bert", "opt", "t5"]


class Recorder:
    """A torch.compile backend that runs the captured graph as it is and counts the captures."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


# ----- the primitive (a recording backend: no code generation) --------------------------------
def test_compile_runs_the_forward_through_the_backend_and_keeps_names():
    model = _mlp()
    ref = copy.deepcopy(model)
    backend = Recorder()
    sch = slapo.create_schedule(model)
    sch.compile(backend=backend)
    assert compiled(model) and model.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)  # the same aten ops, eagerly
    model(x)
    assert backend.graphs == 1  # captured once, then reused
    # A deepcopy runs its own parameters through the same compiled code.
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.add_(1.0)
    torch.testing.assert_close(twin(x), _eager(twin, x), rtol=0, atol=0)
    assert not torch.equal(twin(x), model(x))
    assert backend.graphs == 1  # the copy reuses the compiled code (same class, same guards)


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layers of ``model`` one by one: its own modules, none compiled."""
    out = x
    for layer in model:
        out = layer(out)
    return out


def test_grad_only_runs_eagerly_without_gradients():
    model = _mlp()
    backend = Recorder()
    slapo.create_schedule(model).compile(backend=backend, grad_only=True)
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert backend.graphs == 0
    model(torch.randn(4, 8))
    assert backend.graphs == 1


def test_compile_failures_are_typed_errors_naming_the_module():
    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    model = nn.Sequential(nn.Linear(2, 2), Breaks())
    sch = slapo.create_schedule(model)
    sch["1"].compile(backend=Recorder(), fullgraph=True)
    with pytest.raises(CompileError, match=r'compile on "1".*fullgraph') as err:
        model(torch.randn(1, 2))
    assert isinstance(err.value, slapo.SlapoError)

    def failing(gm, example_inputs):
        raise RuntimeError("no code for you")

    model = _mlp()
    slapo.create_schedule(model)["0"].compile(backend=failing)
    with pytest.raises(CompileError, match=r'compile on "0".*no code for you'):
        model(torch.randn(1, 8))


def test_bad_compile_requests_are_clear_errors():
    sch = slapo.create_schedule(_mlp())
    with pytest.raises(slapo.PrimitiveError, match=r'"0": unknown backend .indcutor.*inductor'):
        sch["0"].compile(backend="indcutor")
    with pytest.raises(slapo.PrimitiveError, match="mode must be one of"):
        sch["0"].compile(mode="fastest")
    with pytest.raises(slapo.PrimitiveError, match="'aot_eager' takes none of them"):
        sch["0"].compile(backend="aot_eager", options={"fallback_random": True})
    with pytest.raises(slapo.PrimitiveError, match="options must be a dict"):
        sch["0"].compile(options=[("fallback_random", True)])
    scripted = slapo.create_schedule(nn.Sequential(torch.jit.script(nn.Linear(2, 2))))
    with pytest.raises(slapo.PrimitiveError, match="TorchScript module cannot be compiled"):
        scripted["0"].compile()
    sch["0"].compile(backend=Recorder())
    with pytest.raises(slapo.PrimitiveError, match='"0" already has compile'):
        sch["0"].compile(backend=Recorder())
    with pytest.raises(slapo.PrimitiveError, match="Apply checkpoint first, then compile"):
        sch["0"].checkpoint()
    with pytest.raises(slapo.SlapoError, match="ckpt_policy must be one of"):
        Knobs(ckpt_policy="save_everything")
    with pytest.raises(slapo.SlapoError, match="compile_blocks must be True or False"):
        Knobs(compile_blocks="yes")


def test_every_compiled_block_keeps_its_own_compiled_code():
    # Each block has its own class, which dynamo's guards check: one cache entry per block, more
    # than torch's default limit of 8 entries per code object. None may fall back to eager.
    layers = nn.Sequential(*[_mlp(i) for i in range(12)])
    backend = Recorder()
    sch = slapo.create_schedule(layers)
    for name in sch.child:
        sch[name].checkpoint(policy="save_matmuls")
        sch[name].compile(backend=backend)
    layers(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert backend.graphs == 12


def test_the_ready_schedules_apply_checkpoint_then_compile():
    sch = apply_schedule(H.make("llama"), **recommended_knobs("llama", compile_blocks=True))
    prims = [(r.path, r.name) for r in sch.metadata.primitives]
    for i in range(2):
        block = f"model.layers.{i}"
        assert prims.index((block, "checkpoint")) < prims.index((block, "compile"))
    # the whole model last: its compiled region holds every primitive applied before
    assert prims[-1] == (sch.path, "compile") and prims.count((sch.path, "compile")) == 1
    assert {r.kwargs.get("policy") for r in sch.metadata.primitives if r.name == "checkpoint"} == {
        recommended_knobs("llama")["ckpt_policy"]
    }
    assert set(recommended_knobs("gpt2")) <= set(Knobs.__dataclass_fields__)
    assert recommended_knobs("gpt2", ckpt_ratio=0.5)["ckpt_ratio"] == 0.5


# ----- inductor: every family, one process ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_blocks_keep_loss_and_gradients(family):
    # Block 0 compiled and selectively checkpointed, block 1 compiled alone, dropout on.
    ref = H.make(family, dropout=0.1)
    test = H.twin(ref)
    apply_schedule(test, ckpt_ratio=0.5, ckpt_policy="save_matmuls", compile_blocks=True)
    # The compiled dropout draws from torch's generator as eager code does (the compile
    # primitive's default): the same masks as the reference. float32 tolerance: inductor fuses
    # the elementwise ops and sums the norms' and softmax's reductions in another order (ulps).
    H.assert_same_step(ref, test)
    H.assert_same_step(ref, test, data=H.batch(seed=1))  # the compiled code is reused


@pytest.mark.slow
# a decoder, a Llama and an encoder-decoder; bert and opt compile their blocks in the test above
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_the_recommended_schedule_keeps_loss_and_gradients(family):
    # The whole model compiled around selectively checkpointed blocks (each family's CPU default),
    # dropout on. Its dropout draws bulk masks (compile_rng="bulk"): the reference draws the same
    # ones (bulk_dropout_masks); float32 tolerance as above.
    ref = H.make(family, dropout=0.1)
    test = H.twin(ref)
    knobs = recommended_knobs(family)
    apply_schedule(test, **knobs)
    assert knobs["compile_rng"] == "bulk"
    for data in (H.batch(), H.batch(seed=1)):
        H.assert_same_step(ref, test, data=data, ref_context=bulk_dropout_masks())


def test_compile_model_refuses_pipeline_stages():
    with pytest.raises(slapo.SlapoError, match="compile_model.*num_stages"):
        Knobs(compile_model=True, num_stages=2)


def test_selective_checkpoint_knob_is_exact():
    for policy in CKPT_POLICIES:
        ref = H.make("gpt2", dropout=0.1)
        test = H.twin(ref)
        apply_schedule(test, ckpt_ratio=1.0, ckpt_policy=policy)
        # Bit-exact: the same kernels rerun on the same operands under the restored RNG state
        # (see tests/primitives/test_selective_checkpoint.py).
        H.assert_same_step(ref, test, exact=True)


# ----- with tensor parallelism: 2 gloo ranks --------------------------------------------------
@pytest.fixture(scope="module")
def selective_tp():
    return check_all(run_workers(tp_job, 2, args=(False,), deadline=150.0))


@pytest.fixture(scope="module")
def compiled_tp():
    return check_all(run_workers(tp_job, 2, args=(True,), deadline=500.0))


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", FAMILIES)
def test_selective_checkpoint_with_tensor_parallelism(selective_tp, family):
    assert_check(selective_tp, family)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(560)
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_blocks_with_tensor_parallelism(compiled_tp, family):
    assert_check(compiled_tp, family)
