"""A scheduled, built model trains under transformers.Trainer unchanged."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_models as H
import slapo
from slapo.model_schedule import apply_schedule

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


class Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, H.VOCAB, (H.SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def train_losses(model, out_dir) -> list[float]:
    """Trainer's logged loss at every step (its defaults otherwise, same seed every run)."""
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=3, report_to=[],
        use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tiny())
    result = trainer.train()
    assert result.global_step == 3
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("knobs", [{"ckpt_ratio": 1.0}, {"ckpt_ratio": 0.5, "fused_loss": True}])
def test_trainer_trains_a_scheduled_model(tmp_path, knobs):
    """Checkpointed blocks and the fused loss under Trainer: the unscheduled loss curve (Trainer
    logs losses rounded to 4 digits; the fused loss sums in chunks, hence the tolerance)."""
    model = H.make("llama")
    ref = H.twin(model)
    sch = apply_schedule(model, attn_op="sdpa", **knobs)
    model, _ = slapo.build(sch, init_weights=False)
    losses = train_losses(model, tmp_path / "scheduled")
    expected = train_losses(ref, tmp_path / "plain")
    assert len(losses) == 3
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-4)
