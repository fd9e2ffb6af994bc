"""Selective checkpointing (``checkpoint(policy=...)``): the kept outputs, the recompute of the
rest under the restored RNG states, and the same loss and gradients as without checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from hf_models import LAYERS, assert_same_step, make, twin
from slapo.random import CHECKPOINT_POLICIES, checkpoint_policy
from slapo.train import PeakMemory

aten = torch.ops.aten
CKPT = torch.utils.checkpoint.CheckpointPolicy


def layer_paths(sch, family):
    return [f"{LAYERS[family]}.{name}" for name in sch[LAYERS[family]].child]


@pytest.mark.parametrize("policy", sorted(CHECKPOINT_POLICIES))
@pytest.mark.parametrize("family", list(LAYERS))
def test_selective_checkpoint_of_every_layer_is_bit_identical_with_dropout(family, policy):
    ref = make(family, dropout=0.1)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    for path in layer_paths(sch, family):
        sch[path].checkpoint(policy=policy)
    assert [r.kwargs for r in sch.metadata.primitives] == [{"policy": policy}] * 2
    # Bit-exact on any CPU and thread count: the recompute reruns the same kernels on the same
    # operands under the restored RNG state (the same dropout masks), the kept outputs are the
    # very tensors of the forward, and the autograd graph is kept (gradients summed in the same
    # order). A mask drawn anew on recompute would move the gradients by far more than ulps.
    assert_same_step(ref, model, exact=True)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes saved for backward by one forward (``PeakMemory``'s count), loss = sum: it saves
    nothing itself."""
    with PeakMemory(model, None) as mem:
        model(x).sum().backward()
    return round(mem.activation_mb * 2**20)


def test_the_kept_outputs_are_what_the_saved_tensor_hooks_count():
    x = torch.randn(32, 16)
    plain, full, selective, narrow = _mlp(), _mlp(), _mlp(), _mlp()
    slapo.create_schedule(full).checkpoint()
    slapo.create_schedule(selective).checkpoint(policy="save_matmuls")
    slapo.create_schedule(narrow).checkpoint(policy="save_narrow_matmuls")
    inputs = 32 * 16 * 4  # a checkpoint saves its inputs, for the recompute
    assert _saved_bytes(full, x) == inputs
    # And the two matmul outputs (addmm: 32 x 64 and 32 x 16 float32), nothing else.
    assert _saved_bytes(selective, x) == inputs + (32 * 64 + 32 * 16) * 4
    # The first linear layer widens (16 -> 64): recomputed; the second one's output is kept.
    assert _saved_bytes(narrow, x) == inputs + 32 * 16 * 4
    # Without checkpointing: x, the GELU input, the dropout mask and output, ...
    assert _saved_bytes(plain, x) > inputs + (32 * 64 + 32 * 16) * 4


def test_save_attention_keeps_the_attention_kernel_output():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v).sum(dim=1)

    torch.manual_seed(0)
    model = Attn()
    ref = copy.deepcopy(model)
    slapo.create_schedule(model).checkpoint(policy="save_attention")
    x = torch.randn(2, 5, 8, requires_grad=True)
    saved = _saved_bytes(model, x)
    # The input (for the recompute), the kernel's output (2 x 2 x 5 x 4 float32) and its
    # logsumexp (2 x 2 x 5; the CPU flash kernel's other outputs are empty); not the projection.
    assert saved == (2 * 5 * 8 + 2 * 2 * 5 * 4 + 2 * 2 * 5) * 4, saved
    y_ref, y = ref(x), model(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same kernels: bit-equal
    g_ref = torch.autograd.grad(y_ref.sum(), [x, *ref.parameters()])
    g = torch.autograd.grad(y.sum(), [x, *model.parameters()])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_forked_dropout_draws_the_same_mask_on_recompute():
    # fork_rng swaps the tracker's state in; the selective recompute must restore that state too
    # (not only torch's), or the dropout inside the forked block draws a new mask in backward.
    def scheduled(checkpoint: bool) -> nn.Module:
        model = _mlp()
        sch = slapo.create_schedule(model)
        sch["2"].fork_rng()
        if checkpoint:
            sch.checkpoint(policy="save_matmuls")
        return model

    def step(model):
        slapo.set_random_seed(7, tp_rank=0)
        x = torch.randn(32, 16)
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    try:
        for got, want in zip(step(scheduled(True)), step(scheduled(False))):
            # Bit-exact: the same kernels on the same operands under the same RNG states.
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        slapo.random.get_cuda_rng_tracker().reset()


def test_policy_forms():
    keep = checkpoint_policy("save_matmuls")
    assert keep(None, aten.mm.default) == CKPT.MUST_SAVE
    assert keep(None, aten.gelu.default) == CKPT.PREFER_RECOMPUTE
    listed = checkpoint_policy([aten.addmm, aten.gelu.default])  # a packet means every overload
    assert listed(None, aten.addmm.out) == CKPT.MUST_SAVE
    assert listed(None, aten.gelu.default) == CKPT.MUST_SAVE
    assert listed(None, aten.mm.default) == CKPT.PREFER_RECOMPUTE
    assert checkpoint_policy(aten.mm.default)(None, aten.mm.default) == CKPT.MUST_SAVE

    def mine(ctx, op, *args, **kwargs):
        return op == aten.gelu.default

    assert checkpoint_policy(mine) is mine
    x = torch.randn(4, 16)
    for policy in ([aten.addmm], mine, "save_attention"):
        model, ref = _mlp(), _mlp()
        slapo.create_schedule(model).checkpoint(policy)  # positional: checkpoint("save_matmuls")
        torch.manual_seed(3)
        model(x).sum().backward()
        torch.manual_seed(3)
        ref(x).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # as in the first test


def test_slapo_checkpoint_takes_a_policy():
    layer = _mlp()
    ref = copy.deepcopy(layer)
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(5)
    y = slapo.checkpoint(layer, x, use_reentrant=False, policy="save_matmuls")
    torch.manual_seed(5)
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)
    with pytest.raises(slapo.SlapoError, match="needs use_reentrant=False"):
        slapo.checkpoint(layer, x, policy="save_matmuls")


def test_subgraph_checkpoint_takes_a_policy():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch.trace()
    found = sch.find(lambda x: F.gelu(slapo.call_module("0", x)))
    sch.checkpoint(found, policy="save_matmuls")
    assert sch.child["checkpoint"].mod.policy is not None
    x = torch.randn(3, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # as in the first test


def test_bad_policies_are_clear_errors():
    sch = slapo.create_schedule(_mlp())
    with pytest.raises(slapo.PrimitiveError, match=r'on "0".*unknown checkpoint policy .save_all'):
        sch["0"].checkpoint(policy="save_all")
    with pytest.raises(slapo.PrimitiveError, match="is not an aten op"):
        sch["0"].checkpoint(policy=["mm"])
    with pytest.raises(slapo.PrimitiveError, match="list of ops to save is empty"):
        sch["0"].checkpoint(policy=[])
    with pytest.raises(slapo.PrimitiveError, match="must be a name"):
        sch["0"].checkpoint(policy=3)
    with pytest.raises(slapo.PrimitiveError, match="policy is given twice"):
        sch["0"].checkpoint("save_matmuls", policy="save_attention")
    with pytest.raises(slapo.PrimitiveError, match=r"unexpected arguments \['polcy'\]"):
        sch["0"].checkpoint(polcy="save_matmuls")
    assert not sch.metadata.primitives  # nothing half-applied
