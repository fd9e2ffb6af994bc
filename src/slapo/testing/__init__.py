"""Test and benchmark harnesses, not part of the library: the model zoo of tiny transformers
causal LMs and the checks that Slapo's schedules train them as plain PyTorch does.

``import slapo`` never imports this package (``tests/test_import_light.py`` checks it); the
test suite and ``benchmarks/model_coverage.py`` do. Three modules, one job each:

* :mod:`~slapo.testing.zoo_tables`: what is peculiar to each ``model_type`` (data only);
* :mod:`~slapo.testing.zoo_models`: tiny configs, models and batches, one training step;
* :mod:`~slapo.testing.zoo_checks`: the verdicts (:class:`CheckResult`) and the checks.

The package re-exports their public names.

Example:
    >>> from slapo import testing as zoo
    >>> zoo.check_schedule("llama", ckpt_ratio=1.0).status
    'equal'
"""

from .zoo_checks import (
    STATUSES,
    CheckResult,
    check_eager,
    check_schedule,
    check_tp,
    check_trace,
    compare_grads,
    has_hf_tp_plan,
    worst,
)
from .zoo_models import (
    ZooError,
    causal_lm_types,
    sample_batch,
    tiny_config,
    tiny_model,
    train_step,
)
from .zoo_tables import CONFIGS_WRITTEN_FOR

__all__ = [
    "CONFIGS_WRITTEN_FOR",
    "STATUSES",
    "CheckResult",
    "ZooError",
    "causal_lm_types",
    "check_eager",
    "check_schedule",
    "check_tp",
    "check_trace",
    "compare_grads",
    "has_hf_tp_plan",
    "sample_batch",
    "tiny_config",
    "tiny_model",
    "train_step",
    "worst",
]
