"""A scheduled, built model trains under transformers.Trainer unchanged."""

from __future__ import annotations

import hf_models as H
import pytest
import torch
import transformers

import slapo
from slapo.model_schedule import apply_schedule

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


class Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, H.VOCAB, (H.SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("knobs", [{"ckpt_ratio": 1.0}, {"ckpt_ratio": 0.5, "fused_loss": True}])
def test_trainer_trains_a_scheduled_model(tmp_path, knobs):
    model = H.make("llama")
    sch = apply_schedule(model, attn_op="sdpa", **knobs)
    model, _ = slapo.build(sch, init_weights=False)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
        use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tiny())
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not model.model.layers[0].mlp.up_proj.weight.detach().equal(before)
