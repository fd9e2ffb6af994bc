"""Tutorial 6: auto-tuning a schedule's knobs with ``Space``, ``Symbol`` and ``slapo.tune``.

What you learn:
  * A schedule has knobs (the batch size, how many layers to checkpoint, ...). A ``Space`` holds
    them as ``Symbol``s with candidate values; ``update_space(args, space)`` creates them, and a
    symbol's candidates may depend on earlier ones (``sym.value``), which prunes invalid
    combinations, e.g. "a bigger batch needs more checkpointing to fit in memory".
  * ``slapo.tune.Tuner`` runs your training command once per configuration (the knobs become
    flags: ``--batch-size 8 --ckpt-layers 1``), reads the last JSON line it prints, and records
    each result in a ``Database`` (a JSON file). A re-run resumes: nothing is measured twice.
  * The same is on the command line: ``slapo tune --config cfg.py --db results.json -- <command>``.

Run it: ``python docs/tutorials/06_tuning.py`` (it runs itself with ``--trial`` as the command).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import slapo
from slapo.tune import Database, Space, Tuner

LAYERS = 2


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def trial(argv: list[str]) -> None:
    """One measurement: schedule the model with the given knobs, train 3 steps, print JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--ckpt-layers", type=int, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    sch = slapo.create_schedule(TinyLM())
    for i in range(args.ckpt_layers):  # the knob: checkpoint the first ckpt_layers layers
        sch[f"layers.{i}"].checkpoint()
    model, optimizer = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    data = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(3):
        ids = torch.randint(0, 64, (args.batch_size, 33), generator=data)
        loss = slapo.train_step(
            model,
            (ids[:, :-1], ids[:, 1:]),
            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
        )
        optimizer.step()
        optimizer.zero_grad()
    tokens_per_s = 3 * args.batch_size * 32 / (time.perf_counter() - start)
    print(json.dumps({"throughput": tokens_per_s, "loss": loss.item()}))  # the LAST line counts


def update_space(args, space):
    """The knobs: the batch size, and (depending on it) how many layers to checkpoint."""
    batch = space.create_symbol("batch_size", [4, 8])
    # A made-up memory model: activations of batch * (uncheckpointed layers) must stay <= 8,
    # so batch 8 needs a checkpointed layer. (An empty candidate list would prune the branch.)
    space.create_symbol(
        "ckpt_layers", [c for c in range(LAYERS) if batch.value * (LAYERS - c) <= 8]
    )
    return space


def main() -> None:
    # ---- 1. The space: every valid configuration, in enumeration order. -------------------------
    space = Space(update_space)
    configs = list(space)
    print(f"{len(configs)} configurations:")
    for cfg in configs:
        print("  ", Space.cfg_dict_to_str(cfg))
    assert {"batch_size": 8, "ckpt_layers": 0} not in configs  # pruned by the dependency
    assert len(configs) == 3

    # ---- 2. Tune: run every configuration, keep the results in a JSON database. -----------------
    with tempfile.TemporaryDirectory() as tmp:
        db_path = Path(tmp) / "results.json"
        command = [sys.executable, __file__, "--trial"]  # + --batch-size B --ckpt-layers C
        tuner = Tuner(space, command, Database(db_path), progress=False, timeout=120)
        records = tuner.run()
        for rec in records:
            status = rec["status"]
            assert status == "ok", rec.get("error") or rec.get("output_tail")
            print(
                f"trial {rec['trial']}: {Space.cfg_dict_to_str(rec['config'])} -> "
                f"{rec['result']['throughput']:.0f} tokens/s, loss {rec['result']['loss']:.5f}"
            )
        assert len(records) == len(configs)
        best = tuner.best(1)[0]
        print("best:", Space.cfg_dict_to_str(best["config"]))

        # Checkpointing trades compute for memory but never changes the math: with batch 4, both
        # checkpointing choices reach the same loss. (Same kernels on the same operands, in the
        # same order, on one machine: bit for bit, whatever the CPU.)
        losses = {r["result"]["loss"] for r in records if r["config"]["batch_size"] == 4}
        assert len(losses) == 1, losses

        # ---- 3. The database is a file: a second run resumes and measures nothing again. --------
        on_disk = Database(db_path)
        print(f"{len(on_disk)} records in {db_path.name}")
        assert len(on_disk) == len(configs)
        again = Tuner(space, command, on_disk, progress=False).run()
        assert [r["trial"] for r in again] == [r["trial"] for r in records]
    print("OK: tuned the space, recorded every trial, and resumed without re-running")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trial"]:
        trial(sys.argv[2:])
    else:
        main()
