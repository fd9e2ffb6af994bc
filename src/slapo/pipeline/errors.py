"""The error every rank of a pipeline raises when one of its stages fails."""

from __future__ import annotations

from ..exceptions import SlapoError

__all__ = ["PipelineError"]


class PipelineError(SlapoError, RuntimeError):
    """A pipeline step failed on some stage; raised on every rank with that stage's error."""
