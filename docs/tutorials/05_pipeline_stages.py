"""Tutorial 5: pipeline parallelism with ``cut_pipeline_stage``, on two processes.

What you learn:
  * ``sch[path].cut_pipeline_stage()`` ends a pipeline stage right after the module at ``path``;
    ``n`` cuts make ``n + 1`` stages, one per rank here. The model's code does not change.
  * ``slapo.build(sch, target="pipeline", ...)`` splits the model at the cuts and runs this rank's
    stage under a ``torch.distributed.pipelining`` schedule (GPipe here; 1F1B and others too),
    splitting each batch into ``num_microbatches`` microbatches. The stages are built on the first
    training step: no example inputs are needed.
  * Training uses the same loop as every other target: ``slapo.train_step(engine, batch)``, then
    ``optimizer.step()`` and ``optimizer.zero_grad()``. The loss comes back on every rank.
  * Each rank keeps only its stage's parameters, under the names they have in the full model,
    and they train exactly like the single-process model's.

Run it on two CPU processes:

    torchrun --nproc-per-node 2 docs/tutorials/05_pipeline_stages.py
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import slapo

env = slapo.env.setup(backend="gloo", timeout=60)  # every collective gives up after 60 s
rank = env.rank
torch.manual_seed(0)  # the same initial weights on every rank
VOCAB, HIDDEN, LAYERS = 64, 32, 4


def say(*args):
    if rank == 0:
        print(*args, flush=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(logits, labels):  # called by the last stage on each microbatch
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


reference = TinyLM()  # trained in one process, as the oracle
model = copy.deepcopy(reference)

# ---- 1. Cut: stage 0 = embed + layers 0-1, stage 1 = layers 2-3 + head. -------------------------
sch = slapo.create_schedule(model)
sch["layers.1"].cut_pipeline_stage()

# ---- 2. Build the pipeline. The stages are traced and split on the first step's first microbatch
# (torch's pipelining infers the shapes between stages then); every later batch has that shape.
# The optimizer adopts this rank's stage parameters at that point. (example_inputs=one_batch
# builds the stages right here instead.)
data = torch.Generator().manual_seed(1)
batches = [torch.randint(0, VOCAB, (8, 17), generator=data) for _ in range(3)]
engine, optimizer = slapo.build(
    sch,
    target="pipeline",
    schedule="GPipe",
    num_microbatches=4,  # a batch of 8 runs as 4 microbatches of 2
    loss_fn=loss_fn,
    optimizer=torch.optim.SGD,
    optimizer_kwargs={"lr": 0.2},
)

# ---- 3. The one training loop; the reference trains on the same batches in one process. ---------
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
for step, ids in enumerate(batches):
    inputs, labels = ids[:, :-1], ids[:, 1:]
    loss = slapo.train_step(engine, (inputs, labels))  # (inputs..., target): the last is the target
    optimizer.step()
    optimizer.zero_grad()

    ref_loss = loss_fn(reference(inputs), labels)  # equal microbatches: mean of means = mean
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    say(f"step {step}: pipeline {loss.item():.5f}   one process {ref_loss.item():.5f}")
    # Microbatches sum the gradients in another order than one full batch: float32 tolerance.
    torch.testing.assert_close(loss, ref_loss.detach())

# ---- 4. This rank's parameters, by their names in TinyLM, equal the reference's. -----------------
mine = dict(engine.named_parameters())
say("rank 0 holds:", sorted({n.rsplit(".", 2)[0] for n in mine}))
print(f"rank {rank}: {len(mine)} parameter tensors", flush=True)
ref_params = dict(reference.named_parameters())
for name, p in mine.items():
    torch.testing.assert_close(p, ref_params[name], msg=lambda m, n=name: f"{n}: {m}")
print(f"rank {rank}: OK, the stage's weights match the one-process model after 3 steps", flush=True)
slapo.env.teardown()
