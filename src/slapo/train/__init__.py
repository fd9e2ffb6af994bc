"""The main job: train a transformers model on the embedded corpus or your data, scheduled.

Run it as ``slapo train`` (or ``python -m slapo train``); ``slapo train --help`` lists the options.
Under ``torchrun --nproc-per-node N`` it runs tensor (``--tp``), data (``--target ddp|fsdp``) or
pipeline (``--target pipeline --num-stages N``) parallel.

================  =====================================================================
``config``        :class:`TrainConfig`: the options; the command line is generated from it
``presets``       the model families and sizes, their ready schedules, the causal LM loss
``model_source``  ``--model``: a family, a transformers model type or a model directory
``tokenizer``     the run's tokenizer: the model directory's, ``--tokenizer``'s, or bytes
``datafiles``     ``--data``: the .txt / .jsonl / .parquet files and their text
``token_cache``   ``--data`` tokenized once, packed, memory-mapped from a cache file
``inputs``        :func:`prepare_inputs`: model, tokenizer and data resolved and checked first
``generic``       the generic plan, for a model type without a ready schedule
``uses``          how the main job uses each build target (``TARGET_USES``)
``layout``        the process layout, the build target and the schedule of a run
``loop``          :class:`Runner` and :func:`train`: one loop for every target
``memory``        :class:`PeakMemory`
``lr_schedule``   ``--lr-schedule`` / ``--warmup-steps``: the learning rate of every step
``evaluation``    ``--eval-data`` / ``--eval-fraction``: eval loss and perplexity
``state``         ``--save`` / ``--save-every`` / ``--resume``: Hugging Face dir + train state
``events``        TensorBoard event files beside ``metrics.json``
``report``        ``metrics.json``, ``loss.png`` and the end-of-run table
``cli``           ``slapo train``
================  =====================================================================

Example:
    >>> from slapo.train import TrainConfig, train
    >>> # three real training steps take 10-30 seconds on a laptop CPU: not run by the test suite
    >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))  # doctest: +SKIP
"""

from __future__ import annotations

from .config import InputError, TrainConfig
from .inputs import RunInputs, prepare_inputs
from .job_layout import Layout, setup_layout
from .loop import Runner, make_batches, run_once, train
from .presets import MODELS, PRESETS, build_model, default_schedule
from .report import format_summary, write_outputs
from .run_memory import PeakMemory
from .train_cli import add_parser
from .uses import TARGET_USES, target_choices

#: ``--target``'s choices (:func:`~slapo.train.uses.target_choices`: the registered build targets
#: the main job has a use for).
TARGETS = target_choices()

__all__ = [
    "MODELS",
    "PRESETS",
    "TARGETS",
    "TARGET_USES",
    "InputError",
    "Layout",
    "PeakMemory",
    "RunInputs",
    "Runner",
    "TrainConfig",
    "add_parser",
    "build_model",
    "default_schedule",
    "format_summary",
    "make_batches",
    "prepare_inputs",
    "run_once",
    "setup_layout",
    "target_choices",
    "train",
    "write_outputs",
]
