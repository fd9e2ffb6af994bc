"""Layout-free checkpoints: safetensors tensors and JSON metadata, no pickle anywhere.

A directory written by :func:`save_checkpoint` holds::

    model.safetensors           # or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    optimizer.safetensors       # with an optimizer (or optimizer-0000i-of-0000N.safetensors)
    config.json                 # for a transformers model
    slapo_checkpoint.json       # the completion marker: format, keys, files, optimizer metadata

Every model tensor is stored once, at its *full* (unsharded, unpadded) shape, under its name in
the user's model (tied duplicates once, as Hugging Face does), so ``transformers``
``from_pretrained(directory)`` loads a checkpoint of a transformers model whatever layout wrote
it: one process, tensor parallel, pipeline stages (each rank writes its stages' tensors), data
parallel (one replica writes), DeepSpeed ZeRO 1/2 (the optimizer's partitions gathered by
parameter). :func:`load_checkpoint` reads the full tensors and keeps this rank's part.

Why not ``torch.distributed.checkpoint``: its default format keeps ``.metadata`` as a pickle (a
crafted one runs code on load), and ``dcp.load`` passes metadata and load plans between ranks
through pickle-based object collectives. Here a load parses JSON and safetensors headers only,
and the ranks exchange JSON in byte tensors; the old ``slapo-dcp-v1`` format is refused unread.

The modules, from the bottom: :mod:`.format` (files, marker, tree encoding), :mod:`.atomic` (the
directory swap and its crash recovery), :mod:`.layout` (what a rank holds and how a full tensor
maps onto it), :mod:`.optim` (optimizer state by parameter name), :mod:`.io` (save and load).

Example:
    >>> import slapo
    >>> import torch, transformers
    >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64,
    ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
    >>> engine = transformers.GPT2LMHeadModel(config)   # or what slapo.build returned
    >>> optimizer = torch.optim.AdamW(engine.parameters())
    >>> slapo.save_checkpoint(engine, "ckpt", optimizer)    # every rank of any layout
    >>> type(transformers.AutoModelForCausalLM.from_pretrained("ckpt")).__name__
    'GPT2LMHeadModel'
"""

from . import optim  # noqa: F401  (registers ZeRO's master weights with model_layout)
from .format import FORMAT, MARKER, TREE_FORMAT, CheckpointError
from .io import (
    dtensor_like,
    export_safetensors,
    load_checkpoint,
    load_tree,
    save_checkpoint,
    save_tree,
)
from .model_layout import full_state_dict, model_layout

__all__ = [
    "FORMAT",
    "MARKER",
    "TREE_FORMAT",
    "CheckpointError",
    "dtensor_like",
    "export_safetensors",
    "full_state_dict",
    "load_checkpoint",
    "load_tree",
    "model_layout",
    "save_checkpoint",
    "save_tree",
]
