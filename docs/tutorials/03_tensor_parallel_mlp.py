"""Tutorial 3: a tensor-parallel MLP on two processes with ``shard`` and ``sync``.

What you learn:
  * ``slapo.env.setup()`` starts ``torch.distributed`` from torchrun's environment (gloo on CPU).
  * ``shard(param, axis)`` keeps only this rank's slice of a parameter: fc1 is split by its output
    features ("column parallel"), fc2 by its input features ("row parallel"), Megatron-style.
  * ``sync(mode, op)`` inserts the communication that makes the sharded model compute the same
    function: an all-reduce of fc2's partial outputs in forward (``mode="fwd_post"``) and an
    all-reduce of the input gradient in backward (``mode="bwd_post"``).
  * Each rank then holds half of the MLP's weights and still gets the full model's output,
    loss and (sliced) gradients.

Run it on two CPU processes:

    torchrun --nproc-per-node 2 docs/tutorials/03_tensor_parallel_mlp.py

(``python -m torch.distributed.run`` is the same launcher; a plain ``python`` run is one rank.)
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import slapo

# ---- 1. One process per rank: join the group that torchrun describes. --------------------------
env = slapo.env.setup(backend="gloo", timeout=60)  # every collective gives up after 60 s
rank, world = env.rank, env.world_size
torch.manual_seed(0)  # the same initial weights on every rank


def say(*args):  # print once, from rank 0
    if rank == 0:
        print(*args, flush=True)


class MLP(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


reference = MLP()  # the full model, kept unsharded as the oracle
model = copy.deepcopy(reference)

# ---- 2. Shard the weights. ----------------------------------------------------------------------
sch = slapo.create_schedule(model)
sch["fc1"].shard("weight", axis=0)  # fc1: each rank computes 64 / world of the hidden features
sch["fc1"].shard("bias", axis=0)
sch["fc2"].shard("weight", axis=1)  # fc2: each rank consumes its own hidden features
say(f"fc1.weight on each rank: {tuple(model.fc1.weight.shape)} (full: (64, 16))")
say(f"fc2.weight on each rank: {tuple(model.fc2.weight.shape)} (full: (16, 64))")

# ---- 3. Synchronize: the forward sums fc2's partial products, the backward sums input grads. ----
sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")  # fc2's bias is added after the sum
sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")  # dL/dx: every rank's share summed
model, _ = slapo.build(sch)
say(sch)

# ---- 4. Check against the full model on the same input. -----------------------------------------
x = torch.randn(4, 8, 16, requires_grad=True)  # the same on every rank (seeded above)
x_ref = x.detach().clone().requires_grad_()
out = model(x)
out.pow(2).mean().backward()
ref_out = reference(x_ref)
ref_out.pow(2).mean().backward()

# Partial sums reduced across ranks add in another order than one matmul: float32 tolerance.
torch.testing.assert_close(out, ref_out)
torch.testing.assert_close(x.grad, x_ref.grad)  # thanks to the bwd_post all-reduce
mine = slice(rank * 64 // world, (rank + 1) * 64 // world)  # this rank's hidden features
torch.testing.assert_close(model.fc1.weight.grad, reference.fc1.weight.grad[mine])
torch.testing.assert_close(model.fc1.bias.grad, reference.fc1.bias.grad[mine])
torch.testing.assert_close(model.fc2.weight.grad, reference.fc2.weight.grad[:, mine])
torch.testing.assert_close(model.fc2.bias.grad, reference.fc2.bias.grad)  # replicated
print(f"rank {rank}: OK, output and gradients match the unsharded MLP", flush=True)
slapo.env.teardown()
