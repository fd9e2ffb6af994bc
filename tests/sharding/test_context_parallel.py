"""Context parallelism: loss and every gradient at cp 2 and cp 4 equal one process on the whole
sequence; the load-balanced layout and the typed errors are checked without processes.
"""

from __future__ import annotations

import cp_jobs as jobs
import pytest
import torch
from torch import nn

import hf_models
from dist_utils import assert_check, check_all, run_workers
from slapo.exceptions import SlapoError
from slapo.sharding.context_layout import (
    ContextParallelError,
    global_order,
    local_chunks,
    local_positions,
    merge_sequence,
    split_sequence,
)
from slapo.sharding.context_parallel import ContextParallel, context_parallel

CHECKS_CP2 = [
    "llama",
    "llama_mha",
    "llama_padded",
    "qwen2",
    "gpt2",
    "sensitive",
    "gather_round_trip",
]
CHECKS_CP4 = ["llama", "llama_padded", "qwen2", "gather_round_trip", "subgroup"]


@pytest.fixture(scope="module")
def cp2():
    return check_all(run_workers(jobs.cp_job, 2, timeout=30, deadline=90))


@pytest.fixture(scope="module")
def cp4():
    return check_all(run_workers(jobs.cp_job, 4, timeout=30, deadline=120))


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS_CP2)
def test_cp2(cp2, check):
    assert_check(cp2, check)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("check", CHECKS_CP4)
def test_cp4(cp4, check):
    assert_check(cp4, check)


# ----- layout (no processes) ------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_split_merge_round_trip(world):
    seq = 8 * 3
    x = torch.arange(2 * seq * 5).view(2, seq, 5)
    parts = [split_sequence(x, r, world, dim=1) for r in range(world)]
    assert all(p.shape == (2, seq // world, 5) for p in parts)
    assert torch.equal(merge_sequence(parts, dim=1), x)
    for r, part in enumerate(parts):  # each rank's tokens sit at its global positions
        assert torch.equal(part[0, :, 0] // 5, local_positions(seq, r, world))


def test_load_balanced_chunk_order():
    # cp 4, 16 tokens: 8 chunks of 2; rank r holds chunks r and 7 - r
    assert [local_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    ids = torch.arange(16)[None]
    assert split_sequence(ids, 0, 4).tolist() == [[0, 1, 14, 15]]
    assert split_sequence(ids, 2, 4).tolist() == [[4, 5, 10, 11]]
    assert local_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    gathered = torch.cat([split_sequence(ids, r, 4) for r in range(4)], 1)
    assert torch.equal(gathered.index_select(1, global_order(2, 4)), ids)
    # every rank's causal work (keys visible to its queries) is the same
    work = [int((local_positions(16, r, 4) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work


def test_uneven_length_is_a_typed_error():
    with pytest.raises(
        ContextParallelError, match=r"sequence length 12 .* 2 \* cp size = 8"
    ) as err:
        split_sequence(torch.zeros(1, 12), 0, 4)
    assert isinstance(err.value, SlapoError)
    with pytest.raises(ContextParallelError, match="local length of 3"):
        merge_sequence([torch.zeros(1, 3), torch.zeros(1, 3)])
    with pytest.raises(ContextParallelError, match=r"length 10 .*cp size 2"):
        local_positions(10, 0, 2)


# ----- models context parallelism refuses (checked before any communication) ------------------
def test_non_causal_model_is_refused():
    model = hf_models.make("bert", dropout=0.0)
    with pytest.raises(
        ContextParallelError, match=r'"bert\.encoder\.layer\.0\.attention\.self".*causal'
    ):
        context_parallel(model)


def test_sliding_window_is_refused():
    model = jobs.qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ContextParallelError, match="sliding"):
        context_parallel(model)


class _OwnAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def test_attention_outside_the_interface_is_refused():
    model = hf_models.make("llama", dropout=0.0)
    model.model.layers[1].self_attn = _OwnAttention()
    with pytest.raises(
        ContextParallelError, match=r'"model\.layers\.1\.self_attn" \(_OwnAttention\)'
    ):
        context_parallel(model)


def test_plain_module_is_refused():
    with pytest.raises(ContextParallelError, match="not a transformers PreTrainedModel"):
        context_parallel(nn.Linear(2, 2))


def test_model_is_untouched_by_a_refusal():
    model = hf_models.make("bert", dropout=0.0)
    before = model.config._attn_implementation
    with pytest.raises(ContextParallelError):
        context_parallel(model)
    assert model.config._attn_implementation == before


def test_shard_batch_round_trip():
    data = jobs.batch(padded=True)
    parts = [ContextParallel(None, r, 4).shard_batch(data) for r in range(4)]
    assert torch.equal(merge_sequence([p["input_ids"] for p in parts]), data["input_ids"])
    assert torch.equal(merge_sequence([p["attention_mask"] for p in parts]), data["attention_mask"])
    positions = merge_sequence([p["position_ids"] for p in parts])
    assert torch.equal(positions, torch.arange(jobs.SEQ).expand(2, -1))
    # labels are shifted over the full sequence, so a chunk's last label is the next chunk's token
    shifted = merge_sequence([p["shift_labels"] for p in parts])
    assert torch.equal(shifted[:, :-1], data["labels"][:, 1:])
    assert (shifted[:, -1] == -100).all()


def test_shard_batch_refuses_what_it_cannot_shard():
    cp = ContextParallel(None, 0, 2)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ContextParallelError, match="token_type_ids"):
        cp.shard_batch({"input_ids": ids, "token_type_ids": ids})
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ContextParallelError, match="packed"):
        cp.shard_batch({"input_ids": ids, "position_ids": packed})
    with pytest.raises(ContextParallelError, match="sequence length 6"):
        cp.shard_batch({"input_ids": ids[:, :6]})
