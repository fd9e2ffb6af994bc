"""Pipeline parallelism on torch.distributed.pipelining: partition, tied weights, stage table.

``slapo.build(sch, target="pipeline", ...)`` (``slapo.targets.pipeline``) uses these pieces.
"""

from .errors import PipelineError
from .partition import Partition, partition_model
from .table import StageInfo, format_table, stage_table
from .ties import TiedGradSync, TieGroup, find_tie_groups

__all__ = [
    "Partition",
    "PipelineError",
    "StageInfo",
    "TieGroup",
    "TiedGradSync",
    "find_tie_groups",
    "format_table",
    "partition_model",
    "stage_table",
]
