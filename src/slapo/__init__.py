"""Slapo: a schedule language for training large PyTorch models fast, from the outside.

Example:
    >>> import slapo, torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> sch = slapo.create_schedule(model)
    >>> sch["0"].checkpoint()
    >>> model, optimizer = slapo.build(sch, optimizer=torch.optim.AdamW)
"""

import importlib

# The reference API (seed 000) lists these standard-library names as slapo.OrderedDict,
# slapo.dataclass, slapo.field and slapo.partial: kept importable for code written against it.
from collections import OrderedDict  # noqa: F401
from dataclasses import dataclass, field  # noqa: F401
from functools import partial  # noqa: F401

from . import env, model_schedule, op, primitives, sharding  # noqa: F401  (registers primitives and sync ops)
from .build import build
from .consolidate import consolidate_model
from .exceptions import (
    PrimitiveError,
    PrimitiveTypeError,
    SchedulePathError,
    SlapoError,
    TargetError,
)
from .initialization import init_empty_weights
from .logger import get_logger
from .pattern import ModulePattern, Pattern, Subgraph, call_module
from .pipeline import PipelineError
from .primitives import Primitive, list_primitives, register_primitive
from .random import checkpoint, get_cuda_rng_tracker, is_random_seed_set, set_random_seed
from .schedule import PrimitiveRecord, Schedule, ScheduleMetadata, create_schedule, is_module_list
from .sharding import CollectiveError, vocab_parallel_cross_entropy
from .targets import get_dialect_cls, init_target_engine, train_step
from .tie_weights import analyze_tie_weights
from .tracing import TraceError, trace, trace_module
from .tune import Database, Space, Symbol
from .verify import MetaVerifyError, VerificationError, Verify

__version__ = "0.1.0"

__all__ = [
    "PipelineError",
    "ModulePattern",
    "Pattern",
    "Subgraph",
    "TraceError",
    "call_module",
    "op",
    "trace",
    "trace_module",
    "CollectiveError",
    "analyze_tie_weights",
    "consolidate_model",
    "env",
    "model_schedule",
    "CheckpointError",
    "export_safetensors",
    "load_checkpoint",
    "save_checkpoint",
    "sharding",
    "vocab_parallel_cross_entropy",
    "MemoryEstimate",
    "estimate_layout",
    "estimate_memory",
    "PrimitiveError",
    "PrimitiveTypeError",
    "SchedulePathError",
    "SlapoError",
    "TargetError",
    "MetaVerifyError",
    "VerificationError",
    "Verify",
    "Database",
    "Space",
    "Symbol",
    "Primitive",
    "PrimitiveRecord",
    "Schedule",
    "ScheduleMetadata",
    "build",
    "checkpoint",
    "create_schedule",
    "get_cuda_rng_tracker",
    "get_dialect_cls",
    "get_logger",
    "init_empty_weights",
    "init_target_engine",
    "is_module_list",
    "is_random_seed_set",
    "list_primitives",
    "register_primitive",
    "set_random_seed",
    "train_step",
]

# Checkpoints pull in safetensors and torch.distributed machinery that most schedules never
# use: load it on first use.
_LAZY = {
    name: "checkpoints"
    for name in ("CheckpointError", "export_safetensors", "load_checkpoint", "save_checkpoint")
}
# The memory planner loads fake tensors on first use.
_LAZY.update({name: "memory" for name in ("MemoryEstimate", "estimate_memory", "estimate_layout")})


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slapo' has no attribute '{name}'")
