"""A `slapo train` run that also keeps the weights it trained (for test_gathered_checkpoints.py).

Run under torchrun (or in-process through :func:`train_keeping_weights`): ``python -m
torch.distributed.run --nproc-per-node 2 gathered_checkpoint_job.py OPTIONS_JSON OUT``. At the
final ``--save``, the weights the run trained are written to ``OUT`` (rank 0): gathered whole
with torch's own ``DTensor.full_tensor()`` (FSDP2), or read from RoundPipe's optimizer copies
(what its optimizer stepped), independent of the checkpoint code under test.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import safetensors.torch
import torch


def trained_weights(run: Any) -> dict[str, torch.Tensor]:
    """The trained weights of a run's state by the model's names (collective under FSDP2)."""
    copies = getattr(run.model, "optim_named_parameters", None)
    if callable(copies):  # RoundPipe: its optimizer steps these copies
        return {name: t.detach().clone() for name, t in copies()}
    out = {}
    for name, p in run.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def train_keeping_weights(options: dict[str, Any], out: str) -> dict[str, Any]:
    """`slapo train` with ``options``; at its final save, the trained weights go to ``out``."""
    import slapo.train.loop as loop
    from slapo.train import TrainConfig, train

    save_run = loop.save_run

    def save_and_keep(path: Any, run: Any, final: bool = True) -> None:
        save_run(path, run, final)
        if final:
            weights = trained_weights(run)
            if run.rank == 0:
                safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, out)

    loop.save_run = save_and_keep
    try:
        return train(TrainConfig(**options))
    finally:
        loop.save_run = save_run


if __name__ == "__main__":
    summary = train_keeping_weights(json.loads(sys.argv[1]), sys.argv[2])
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": summary["losses"], "lrs": summary["lrs"],
                          "resumed_at": summary["resumed_at"]}))  # fmt: skip
