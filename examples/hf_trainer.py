"""Train a small causal LM with Hugging Face ``Trainer`` on a Slapo-scheduled model.

    python examples/hf_trainer.py                      # 8 steps on CPU, the scheduled model
    python examples/hf_trainer.py --no-slapo           # the same run, unscheduled
    torchrun --nproc-per-node 2 examples/hf_trainer.py # DDP over 2 CPU processes (gloo)

A Trainer script adds two lines (marked ``# slapo``) between creating the model and handing it to
``Trainer``: the recommended schedule of the model's family, then ``slapo.build``. Everything
else stays Trainer's: its defaults (``remove_unused_columns=True`` keeps the dataset columns
the model's forward names, which the built model shows as the model's own), its optimizer, its
DDP under torchrun. The model is a tiny random-weight GPT-2 over bytes, trained on windows of
the embedded corpus (the Python standard library's source, :func:`slapo.data.default_corpus`).

Dropout is 0: the recommended GPT-2 schedule compiles the model and draws its dropout masks in
bulk, other masks than the eager model's, so only without dropout do the two runs print the
same losses (to float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers

import slapo
import slapo.model_schedule
from slapo.data import default_corpus

SEQ_LEN = 32


def make_model(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 over bytes with random weights drawn from ``seed``, without dropout."""
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


class CorpusWindows(torch.utils.data.Dataset):
    """Fixed windows of the embedded byte corpus: ``input_ids``, ``attention_mask`` and
    ``labels`` (the model shifts them), plus an ``offset`` column the model does not take
    (Trainer drops it, as it drops a raw-text column of a real dataset)."""

    def __init__(self, size: int = 256, seq_len: int = SEQ_LEN) -> None:
        corpus = default_corpus(max(size * seq_len, 20_000))  # its minimum is 10 kB
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.size, self.seq_len = size, seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": ids.clone(),
            "offset": torch.tensor(i * self.seq_len),
        }


def train(
    use_slapo: bool = True, steps: int = 8, output_dir: str = "hf_trainer_out"
) -> transformers.Trainer:
    """Train with Trainer's defaults for ``steps`` steps, logging the loss at each; returns the
    Trainer (its model, its ``state.log_history``)."""
    model = make_model()
    if use_slapo:
        sch = slapo.model_schedule.apply_schedule(model)  # slapo: the recommended schedule
        model, _ = slapo.build(sch)  # slapo: the model to train; Trainer makes its optimizer
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0,
    )  # fmt: skip
    # on a GPU, Trainer moves the model there (add bf16=True to the arguments for mixed precision)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CorpusWindows())
    trainer.train()
    return trainer


def logged_losses(trainer: transformers.Trainer) -> list[float]:
    """The training loss Trainer logged at each step."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-slapo", action="store_true", help="train the unscheduled model")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--json", action="store_true", help="print the losses as one JSON line")
    opts = parser.parse_args(argv)
    losses = logged_losses(train(not opts.no_slapo, opts.steps, opts.output_dir))
    if int(os.environ.get("RANK", "0")) == 0:
        if opts.json:
            print(json.dumps({"losses": losses}))
        else:
            for step, loss in enumerate(losses, 1):
                print(f"step {step}: loss {loss:.4f}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun on gloo, skip the interpreter's finalization (as `slapo train` does): a
        # gloo thread still releasing a finished collective's tensors would ask for the GIL
        # while the interpreter finalizes and abort the finished process (SIGABRT, "terminate
        # called without an active exception"), with or without Slapo.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
