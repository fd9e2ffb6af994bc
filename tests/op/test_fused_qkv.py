"""``from slapo.op.linear import FusedQKV``: BERT's query/key/value replaced by one fused
projection built from them (the same output and gradients), and, on 2 gloo ranks, the fused
projection sharded by heads with the attention output row-parallel (the single-process output and
gradients, each rank's gradient its slice of the full one)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slapo
from dist_utils import check_all, run_workers
from slapo.op.linear import FusedQKV

HIDDEN, HEADS = 32, 4


class QKV(slapo.Pattern):
    """The three projections of one input (a horizontal pattern)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


def bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertModel(config).eval()


def fuse_qkv(sch: slapo.Schedule, world_size: int) -> slapo.Schedule:
    """Slapo's recipe: trace the self-attention, find q/k/v, replace them by a FusedQKV."""
    attn = sch["encoder.layer.0.attention.self"]
    attn.trace()
    subgraphs = attn.find(QKV())
    q, k, v = (attn.get_module(n) for n in subgraphs[0].outputs)
    fused = FusedQKV.from_linears(q, k, v, num_heads=HEADS, world_size=world_size)
    assert attn.replace(fused, subgraphs[0], name="FusedQKV") == "FusedQKV_0"
    return attn


def step(model, ids):
    out = model(ids).last_hidden_state
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).pow(2).mean()
    loss.backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def expected_qkv_grad(grads: dict, kind: str, world_size: int) -> torch.Tensor:
    prefix = "encoder.layer.0.attention.self"
    layout = FusedQKV(HIDDEN, HEADS, world_size, device="meta")
    return layout.interleave(*(grads[f"{prefix}.{p}.{kind}"] for p in ("query", "key", "value")))


def test_the_layout_and_its_inverse():
    q_proj, k_proj, v_proj = (nn.Linear(8, 8) for _ in range(3))
    qkv = FusedQKV.from_linears(q_proj, k_proj, v_proj, num_heads=4, world_size=2)
    x = torch.randn(3, 5, 8)
    for got, lin in zip(qkv(x), (q_proj, k_proj, v_proj)):
        torch.testing.assert_close(got, lin(x))
    # Rank 0's rows: q, k and v of heads 0 and 1 (head size 2), in that order.
    torch.testing.assert_close(qkv.weight[:4], q_proj.weight[:4])
    torch.testing.assert_close(qkv.weight[4:8], k_proj.weight[:4])
    for got, lin in zip(qkv.split(qkv.weight), (q_proj, k_proj, v_proj)):
        torch.testing.assert_close(got, lin.weight)
    with pytest.raises(ValueError, match="world_size=3 must divide num_heads=4"):
        FusedQKV(8, 4, world_size=3)


def test_bert_self_attention_with_a_fused_qkv_gives_the_same_output_and_gradients():
    ref = bert()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    fuse_qkv(sch, world_size=1)
    names = [n for n, _ in sch.mod.named_parameters()]
    assert "encoder.layer.0.attention.self.FusedQKV_0.weight" in names
    assert not any(n.endswith("self.query.weight") for n in names)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out_ref, g_ref = step(ref, ids)
    out, g = step(sch.mod, ids)
    torch.testing.assert_close(out, out_ref)  # one matmul instead of three: float32 tolerance
    for kind in ("weight", "bias"):
        fused = g[f"encoder.layer.0.attention.self.FusedQKV_0.{kind}"]
        torch.testing.assert_close(fused, expected_qkv_grad(g_ref, kind, 1))
    for name, grad in g.items():
        if "FusedQKV" not in name:
            torch.testing.assert_close(grad, g_ref[name], msg=lambda m, n=name: f"{n}: {m}")


def _tensor_parallel_job(rank: int, world: int) -> str:
    ref = bert()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    attn = fuse_qkv(sch, world_size=world)
    attn["FusedQKV_0"].shard("weight", axis=0)
    attn["FusedQKV_0"].shard("bias", axis=0)
    attn["FusedQKV_0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    dense = sch["encoder.layer.0.attention.output.dense"]
    dense.shard("weight", axis=1)
    dense.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    model, _ = slapo.build(sch)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out_ref, g_ref = step(ref, ids)
    out, g = step(model, ids)
    torch.testing.assert_close(out, out_ref)
    params = dict(model.named_parameters())
    for name, grad in g.items():
        if "FusedQKV" in name:
            full = expected_qkv_grad(g_ref, name.rsplit(".", 1)[-1], world)
        else:
            full = g_ref[name]
        spec = slapo.sharding.get_shard_spec(params[name])
        want = spec.local_slice(full) if spec is not None else full
        torch.testing.assert_close(grad, want, msg=lambda m, n=name: f"{n}: {m}")
    # Shards that would mix heads are refused: another axis, or a layout for another group size.
    for world_size, axis, why in ((world, 1, "axis 0"), (1, 0, "laid out for 1 rank")):
        other = slapo.create_schedule(nn.Sequential(FusedQKV(8, 4, world_size=world_size)))
        with pytest.raises(slapo.exceptions.PrimitiveError, match=why):
            other["0"].shard("weight", axis=axis)
    return str(tuple(params["encoder.layer.0.attention.self.FusedQKV_0.weight"].shape))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_head_sharded_fused_qkv_on_two_gloo_ranks_matches_one_process():
    shapes = check_all(run_workers(_tensor_parallel_job, world=2, timeout=60, deadline=240))
    assert shapes == [str((3 * HIDDEN // 2, HIDDEN))] * 2
