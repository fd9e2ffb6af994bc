"""Spawned gloo jobs of the estimator tests: each rank estimates its own tensor-parallel share
and measures a real step of the same schedule (real collectives) to check it."""

from __future__ import annotations

import torch
from measure import batch, measure_step

import hf_models as H
import slapo
from slapo.model_schedule import apply_schedule, fusion

FAMILIES = ["llama", "gpt2", "t5"]


def tp_estimates(rank: int, world: int) -> dict[str, dict[str, int]]:
    """Per family: this rank's estimate and measurement, and the unsharded model's parameters."""
    fusion.COMPILER = None
    out = {}
    for family in FAMILIES:
        data = batch(H.VOCAB)
        full = H.make(family)
        model = H.twin(full)
        sch = apply_schedule(model, group=torch.distributed.group.WORLD, ckpt_ratio=0.5)
        est = slapo.estimate_memory(sch, data)
        real = measure_step(model, data)
        out[family] = {
            "full_params": sum(p.numel() * p.element_size() for p in full.parameters()),
            "est_params": est.params, "real_params": real.params,
            "est_grads": est.grads, "real_grads": real.grads,
            "est_state": est.optimizer_state, "real_state": real.optimizer_state,
            "est_act": est.activations, "real_act": real.saved,
            "est_peak": est.peak, "real_peak": real.peak,
            "rank": est.rank, "world": est.world_size,
        }  # fmt: skip
    return out
