"""WideResNet (:class:`slapo.vision.WideResNet`, WRN-d-k): the Slapo paper's convolutional model.

Tensor parallelism splits each residual block's inner width, Megatron-style with convolutions:
``conv1`` is column-parallel (its output channels split), the BatchNorm ``bn2`` between the two
convolutions is split along the same channels (each channel's statistics are its own, so this is
exact; its running statistics are cut too), ``conv2`` is row-parallel (its input channels split,
the partial outputs all-reduced), and the input gradient of ``conv1`` is all-reduced. No
replicated parameter lives between the two syncs: ``bn1`` and the projection ``shortcut`` read the
block's whole input and the block's output is whole again after ``conv2``'s all-reduce, so every
replicated gradient is the full one on each rank. Dropout inside a block (``dropout > 0``) draws
each rank's masks from the same generator, as in the other families' TP regions.
"""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import blocks, checkpoint_blocks, column, enter, require, row, tp_size
from .knobs import Knobs
from .schedule_registry import register_schedule

#: The layer lists of :class:`slapo.vision.WideResNet`, one per width.
GROUPS = ("layer1", "layer2", "layer3")


@register_schedule(
    "wideresnet",
    unsupported={
        "attn_op": "a WideResNet has no attention; leave attn_op=None",
        "fuse_ops": "a WideResNet has no bias+GELU or bias+dropout to fuse",
        "fused_loss": "a WideResNet ends in a small classifier, not a language-model head whose "
        "logits are worth computing in chunks",
        "sequence_parallel": "a WideResNet has no sequence dimension; its tensor parallelism "
        "splits channels (group= alone)",
        "compile_model": "not supported for a WideResNet yet; use compile_blocks=True",
        "num_stages": "pipeline stages are not supported for a WideResNet yet",
    },
)
def wideresnet(sch: Schedule, k: Knobs) -> None:
    """The WideResNet plan: tensor parallelism inside every block, checkpointing, compilation.

    Example:
        >>> import slapo
        >>> from slapo.model_schedule import apply_schedule
        >>> import torch
        >>> from slapo.vision import WideResNet
        >>> env = slapo.env.setup(rank=0, world_size=1)  # group= needs a process group
        >>> model = WideResNet(depth=16, widen_factor=4)  # from slapo.vision
        >>> sch = apply_schedule(model, ckpt_ratio=0.5, group=torch.distributed.group.WORLD)
        >>> model, optimizer = slapo.build(sch, init_weights=False)
    """
    paths = blocks(sch, *GROUPS)
    if k.tensor_parallel:
        world = tp_size(sch)
        for blk in paths:
            shard_block(sch, blk, world)
    checkpoint_blocks(sch, paths, k.ckpt_ratio, k.selective_policy)
    if k.compile_blocks:
        # After sharding and checkpointing: the compiler sees local shapes and plans the recompute.
        # dynamic=False: the blocks share one forward, and its dynamic-shape recompile (the next
        # width) fails in inductor (torch 2.13) when the block is checkpointed.
        for path in paths:
            sch[path].compile(grad_only=True, rng=k.compile_rng, dynamic=False)


def shard_block(sch: Schedule, blk: str, world: int) -> None:
    """Split the inner width of the residual block at ``blk`` over ``world`` ranks.

    Example:
        >>> import slapo
        >>> from slapo.vision import WideResNet
        >>> sch = slapo.create_schedule(WideResNet(depth=16, widen_factor=4))
        >>> shard_block(sch, "layer2.0", 2)  # conv1, bn2 and conv2 keep half of the channels
    """
    width = sch[f"{blk}.conv1"].mod.out_channels
    require(
        width % world == 0,
        f'tensor parallelism over {world} ranks: "{blk}.conv1" has {width} output channels, '
        f"which do not divide by {world}; use a group size that divides every block's width",
    )
    require(
        sch[f"{blk}.bn2"].mod.weight is not None,
        f'tensor parallelism: "{blk}.bn2" has no affine parameters to shard; use affine BatchNorms',
    )
    column(sch, f"{blk}.conv1")
    for name in ("weight", "bias"):  # the rule cuts the running statistics along
        sch[f"{blk}.bn2"].shard(name, axis=0)
    row(sch, f"{blk}.conv2")
    enter(sch, f"{blk}.conv1")
