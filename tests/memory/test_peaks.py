"""What is alive at a step's peaks, and on which rank: the loss's float32 logits.

A causal LM's backward starts with its largest temporaries: the float32 gradient of the logits
and the log-softmax's input gradient, beside the log-softmax output the forward saved. A rank of
any layout holds them where it computes the loss (FSDP: every rank; a pipeline: the last stage
only), whatever its gradients (none exist yet at that moment).
"""

from __future__ import annotations

import pytest
import torch

import slapo
from slapo.memory import estimate_layout, estimate_memory

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 8192, 2, 128


def _schedule(cut: bool = False):
    cfg = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, use_cache=False,
    )  # fmt: skip
    with slapo.init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg)
    sch = slapo.create_schedule(model)
    if cut:
        sch["model.layers.0"].cut_pipeline_stage()
    return sch


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _temporaries(est, grads: bool = False) -> int:
    """What a rank's live peak holds beyond its parameters, optimizer state, activations and
    engine buffers (no gradient exists at the loss: those of the last step are freed), and its
    gradients where microbatches accumulate into them (``grads``: a pipeline stage)."""
    parts = est.params + est.buffers + est.optimizer_state + est.activations + est.engine
    return est.live_peak - parts - (est.grads if grads else 0)


def test_the_loss_temporaries_are_found_though_the_whole_model_peaks_later() -> None:
    est = estimate_memory(_schedule(), _batch(), precision="bf16")
    logits = BATCH * SEQ * VOCAB * 4
    # this model's float32 gradients outweigh the loss's temporaries: its backward peaks at its
    # end, with every gradient; before any gradient, it peaked at the loss
    assert est.grads_at_peak == est.grads
    assert est.grads_at_other_peak == 0
    assert sum(est.peak_temporaries["backward_other"].values()) >= 2 * logits


def test_an_fsdp_rank_holds_the_loss_temporaries_beside_its_shards() -> None:
    # FSDP shards the gradients: a rank peaks at the loss, holding its temporaries whole, though
    # the whole model (its 16-bit gradients, 4 x vocab x hidden bytes for the embedding and the
    # head alone, exceed those temporaries) peaks at the end of its backward: an estimate that
    # took the whole model's peak and subtracted its gradients lost them.
    est = estimate_layout(_schedule(), _batch(), target="fsdp", dp=8, precision="bf16")
    assert _temporaries(est) >= 2 * BATCH * SEQ * VOCAB * 4


def test_only_the_last_stage_holds_the_loss_temporaries() -> None:
    sch, micro = _schedule(cut=True), BATCH // 2
    stages = [
        estimate_layout(sch, _batch(), target="pipeline", pp=2, rank=r, num_microbatches=2,
                        precision="bf16")
        for r in (0, 1)
    ]  # fmt: skip
    logits = micro * SEQ * VOCAB * 4
    assert _temporaries(stages[1], grads=True) >= 2 * logits
    assert _temporaries(stages[0], grads=True) < logits / 2
