"""``--save`` / ``--save-every`` / ``--resume``: checkpoints of a run, with no pickle anywhere.

A checkpoint directory (the ``full`` layout, :class:`~slapo.train.job_layout.TargetUse`) is a Hugging
Face model directory that also holds the training state::

    config.json, model.safetensors   # the full weights (gathered under --tp): from_pretrained
    tokenizer.json, ...              # the run's tokenizer, when it is not the byte tokenizer
    optimizer.safetensors            # slapo.save_checkpoint's optimizer state (full tensors)
    slapo_checkpoint.json            # slapo.save_checkpoint's marker
    train_state-rank<r>.safetensors  # each rank's RNG streams and data position
    train_state.json                 # step, LR schedule, loss record, model identity: the marker

It is written into ``<DIR>.tmp-train`` and renamed into place once complete (the
``train_state.json`` marker last), so a killed save never leaves a directory that resumes.
``--save-every N`` writes ``DIR/step-NNNNNN`` the same way and keeps the last ``--keep``;
``--resume DIR`` takes ``DIR`` itself, else its latest complete ``step-NNNNNN``.

The weights and optimizer state are :func:`slapo.save_checkpoint`'s, whatever the layout: under
``--tp`` gathered whole, under ``--target fsdp`` FSDP2's DTensor parameters and Adam state
gathered to full tensors (and re-sharded on resume), under ``--target pipeline`` each rank
writes its stages' tensors (a weight tied across stages once), under ``--target deepspeed``
ZeRO's partitioned optimizer state is gathered by parameter (not DeepSpeed's own checkpoints:
they are pickles), under ``--target roundpipe`` the state of RoundPipe's optimizer copies is
saved by the names of the parameters they stand for (and the copies follow the loaded weights).

A target whose state could only be kept one part per rank (the ``per-rank`` layout; no target
of the main job needs it now) saves each rank's whole state with
:func:`slapo.checkpoints.save_tree` into ``DIR.rank<r>`` (``DIR`` itself for one process).

Example:
    >>> from slapo.train import TrainConfig
    >>> from slapo.train.inputs import prepare_inputs
    >>> from slapo.train.job_layout import Layout
    >>> from slapo.train.loop import Runner, make_batches
    >>> cfg = TrainConfig(batch_size=2, seq_len=16)  # a tiny llama, random weights
    >>> runner = Runner(cfg, Layout(), scheduled=False)
    >>> batches, identity = make_batches(cfg, Layout()), model_identity(cfg)
    >>> run = runner.state(batches, new_record(), identity, prepare_inputs(cfg))
    >>> save_run(Path("out"), run)             # on every rank
    >>> sorted(p.name for p in Path("out").iterdir())
    ['config.json', 'model.safetensors', 'slapo_checkpoint.json',
     'train_state-rank0.safetensors', 'train_state.json']
    >>> record = load_run(Path("out"), run)    # a new Runner's run, restored bit for bit
    >>> record["losses"]
    []
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoints.atomic import replace_dir, sibling
from ..checkpoints.format import MARKER, TREE_FORMAT, CheckpointError, write_json
from ..exceptions import InputError
from .config import TrainConfig

__all__ = [
    "STATE_FILE",
    "RunState",
    "check_resume",
    "check_save",
    "checkpoint_path",
    "find_checkpoint",
    "nothing_to_resume",
    "load_run",
    "model_identity",
    "new_record",
    "prune_steps",
    "save_run",
    "step_dir",
]

STATE_FILE = "train_state.json"
FORMAT = "slapo-train-v1"
_TMP, _OLD = ".tmp-train", ".old-train"
_STEP = re.compile(r"step-(\d+)")
#: what an interrupted step save leaves behind (``step-NNNNNN.tmp-train``), never a checkpoint
_STEP_LEFTOVER = re.compile(r"step-\d+(\..+)?")


@dataclass
class RunState:
    """What a checkpoint holds of a run, live: the built model and its optimizer, LR scheduler
    (or None), data batches, the loss record, and how the run is laid out.

    Attributes:
        module: the model whose state-dict names are saved (the schedule's module).
        model: what ``slapo.build`` returned (a per-rank state saves its state dict).
        layout: ``"full"`` or ``"per-rank"`` (the target's ``TargetUse.checkpoint``).
        identity: :func:`model_identity` of the run's model.
        tokenizer: the run's tokenizer (copied into a full checkpoint when it has files).
    """

    cfg: TrainConfig
    module: Any
    model: Any
    optimizer: Any
    scheduler: Any
    batches: Any
    record: dict[str, Any]
    rank: int
    world: int
    layout: str
    identity: dict[str, Any]
    tokenizer: Any = None


def new_record() -> dict[str, Any]:
    """The empty record of a run: per-step losses, learning rates and tokens/s, evaluations.

    Example:
        >>> new_record()["losses"]
        []
    """
    return {"losses": [], "lrs": [], "step_tokens_per_s": [], "eval": [], "seconds": 0.0}


def model_identity(cfg: TrainConfig) -> dict[str, Any]:
    """What ``--resume`` checks a checkpoint's model against: the model type, the parameter
    count and a hash of every state-dict name and full shape of the unscheduled model (built on
    the meta device: nothing allocated, nothing read).

    Example:
        >>> from slapo.train import TrainConfig
        >>> model_identity(TrainConfig(model="gpt2"))["model_type"]
        'gpt2'
    """
    from ..initialization import init_empty_weights
    from .presets import build_model

    with init_empty_weights():
        model = build_model(cfg, weights=False)
    shapes = sorted((k, list(v.shape)) for k, v in model.state_dict().items())
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:24]
    config = getattr(model, "config", None)
    return {
        "model_type": getattr(config, "model_type", type(model).__name__),
        "parameters": sum(p.numel() for p in model.parameters()),
        "shapes": digest,
    }


# ----- where checkpoints are ---------------------------------------------------------------------
def checkpoint_path(path: str | Path, rank: int, world: int) -> Path:
    """A per-rank checkpoint's directory: ``path`` itself for one process; ``path.rank<r>``
    for each of several.

    Example:
        >>> checkpoint_path("ckpt", 1, 2).name
        'ckpt.rank1'
    """
    p = Path(path)
    return p if world == 1 else p.with_name(f"{p.name}.rank{rank}")


def step_dir(save: str | Path, step: int) -> Path:
    """Where ``--save-every`` puts the checkpoint of ``step``.

    Example:
        >>> step_dir("out", 40).name
        'step-000040'
    """
    return Path(save) / f"step-{step:06d}"


def _is_full(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


def _is_tree(path: Path) -> bool:
    try:
        return json.loads((path / MARKER).read_text()).get("format") == TREE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _steps(path: Path) -> list[tuple[int, Path]]:
    """The complete full-layout ``step-NNNNNN`` checkpoints in ``path``, oldest first."""
    if not path.is_dir():
        return []
    found = []
    for child in path.iterdir():
        match = _STEP.fullmatch(child.name)
        if match and _is_full(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def nothing_to_resume(path: str, rank: int = 0, world: int = 1) -> bool:
    """Whether ``--resume path`` names no checkpoint *yet*: the directory does not exist, or holds
    nothing but step saves a killed run left unfinished (``step-NNNNNN.tmp-*``). Such a run
    starts fresh, so that ``torchrun --max-restarts N ... --save DIR --save-every K --resume DIR``
    is one command for the first start and every restart. A directory holding anything else is
    not taken for an empty one (:func:`find_checkpoint` names what is wrong with it).

    Example:
        >>> nothing_to_resume("runs/not-yet")
        True
    """
    p = Path(path).expanduser()
    mine = checkpoint_path(p, rank, world)
    if not p.exists() and not mine.exists():
        return True
    if _is_full(p) or _is_tree(mine) or _steps(p):
        return False
    return p.is_dir() and all(_STEP_LEFTOVER.fullmatch(c.name) for c in p.iterdir())


def find_checkpoint(path: str, rank: int = 0, world: int = 1) -> tuple[Path, str]:
    """The checkpoint ``--resume path`` continues from and its layout (``"full"`` or
    ``"per-rank"``): ``path`` itself, else its latest complete ``step-NNNNNN``.

    Example:
        >>> for step in (10, 20):  # what --save-every left; the marker is written last
        ...     step_dir("killed", step).mkdir(parents=True)
        ...     _ = (step_dir("killed", step) / STATE_FILE).write_text("{}")
        >>> find_checkpoint("killed")   # step-000010 and step-000020, no final save
        (PosixPath('killed/step-000020'), 'full')
    """
    p = Path(path).expanduser()
    if _is_full(p):
        return p, "full"
    if _is_tree(checkpoint_path(p, rank, world)):
        return p, "per-rank"
    steps = _steps(p)
    if steps:
        return steps[-1][1], "full"
    if not p.exists() and not checkpoint_path(p, rank, world).exists():
        raise InputError(f"--resume {path}: no such checkpoint; give a directory --save wrote")
    if p.is_file():  # an old torch.save pickle, say: never loaded (unpickling runs code)
        raise CheckpointError(
            f"--resume {path} is a file (a torch.save pickle?), not a `slapo train --save` "
            "directory; slapo never unpickles: give a directory --save wrote"
        )
    raise InputError(
        f"--resume {path} is not a `slapo train --save` checkpoint (no {STATE_FILE}, nor a "
        "step-NNNNNN checkpoint in it); give a directory --save or --save-every wrote"
    )


def read_state(path: Path) -> dict[str, Any]:
    """The ``train_state.json`` of a full checkpoint, checked to be one.

    Example:
        >>> import json
        >>> Path("done").mkdir()
        >>> _ = (Path("done") / STATE_FILE).write_text(json.dumps({"format": FORMAT, "step": 60}))
        >>> read_state(Path("done"))["step"]
        60
    """
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(
            f"--resume {path}: cannot read {STATE_FILE} ({type(exc).__name__}: {exc}); the "
            "checkpoint is damaged"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InputError(
            f"--resume {path}: {STATE_FILE} is not a {FORMAT} state; give a directory "
            "slapo train --save wrote"
        )
    return state


def check_model(path: Path, saved: Any, identity: dict[str, Any], cfg: TrainConfig) -> None:
    """Raise an :class:`InputError` when the checkpoint holds another model than the run's.

    Example:
        >>> from slapo.train import TrainConfig
        >>> cfg = TrainConfig(model="llama")
        >>> check_model(Path("out"), {"model_type": "gpt2"}, model_identity(cfg), cfg)
        Traceback (most recent call last):
        slapo.exceptions.InputError: --resume out holds a gpt2 model ...
    """
    if saved == identity:
        return
    what = saved if isinstance(saved, dict) else {}
    count = what.get("parameters")
    size = f"{count:,} parameters" if isinstance(count, int) else "other shapes"
    raise InputError(
        f"--resume {path} holds a {what.get('model_type', 'different')} model ({size}), not "
        f"this run's --model {cfg.model} --preset {cfg.preset} ({identity['model_type']}, "
        f"{identity['parameters']:,} parameters); resume with the model it was saved from"
    )


def check_resume(cfg: TrainConfig, rank: int, world: int, identity: dict[str, Any]) -> Path:
    """The checkpoint ``--resume`` names, checked before anything trains or is written: a
    checkpoint, of this run's model, saved by as many processes, short of ``--steps``.

    A per-rank checkpoint is checked when it loads (its state is read whole then).

    Example:
        >>> # illustration: "out" is a checkpoint --save wrote before step 100 (seconds to make)
        >>> from slapo.train import TrainConfig
        >>> identity = model_identity(TrainConfig())  # the run's model
        >>> check_resume(TrainConfig(resume="out", steps=100), 0, 1, identity)  # doctest: +SKIP
        PosixPath('out')
    """
    assert cfg.resume is not None
    path, layout = find_checkpoint(cfg.resume, rank, world)
    if layout != "full":
        return path
    state = read_state(path)
    check_model(path, state.get("model"), identity, cfg)
    saved = (state.get("world"), state.get("tp"), state.get("pp", _stages(cfg)),
             state.get("cp", 1), state.get("ep", 1))  # fmt: skip
    this = (world, cfg.tp, _stages(cfg), cfg.cp, cfg.ep)
    if saved != this:
        flags = "--tp {} --pp {} --cp {} --ep {}"
        raise InputError(
            f"--resume {path} was saved by {saved[0]} process(es) with {flags.format(*saved[1:])}"
            f"; resume it with as many (this run: {world}, {flags.format(*this[1:])}): each "
            "rank's data position and RNG streams are its own"
        )
    step = state.get("step")
    if not isinstance(step, int) or step >= cfg.steps:
        raise InputError(
            f"--resume {path} has trained {step} steps already; pass a --steps beyond it"
        )
    return path


def _stages(cfg: TrainConfig) -> int:
    """The run's pipeline stages (``--pp``, spelled ``--num-stages`` before it)."""
    return int(getattr(cfg, "pp", getattr(cfg, "num_stages", 1)))


def check_save(cfg: TrainConfig) -> None:
    """Refuse a ``--save`` directory that holds anything but a checkpoint of ``slapo train``:
    saving replaces the directory, and must not take a user's files with it.

    Example:
        >>> from slapo.train import TrainConfig
        >>> _ = Path("notes.txt").write_text("mine")
        >>> check_save(TrainConfig(save="."))
        Traceback (most recent call last):
        slapo.exceptions.InputError: --save . holds files that are not a slapo train checkpoint ...
    """
    if cfg.save is None:
        return
    path = Path(cfg.save).expanduser()
    if path.exists() and not path.is_dir():
        raise InputError(f"--save {cfg.save} is a file; give a directory to write the model to")
    if not path.is_dir() or _is_full(path):
        return
    # step checkpoints, and what an interrupted save of one left (step-NNNNNN.tmp-train)
    others = [c.name for c in path.iterdir() if not re.fullmatch(r"step-\d+(\..+)?", c.name)]
    if others:
        raise InputError(
            f"--save {cfg.save} holds files that are not a slapo train checkpoint (e.g. "
            f"{sorted(others)[0]}); saving replaces the directory: give a new or empty one"
        )


# ----- saving -----------------------------------------------------------------------------------
def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, torch.Tensor]:
    """The RNG streams a step draws from: the CPU generator, and CUDA's where it is used."""
    state = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def _rank_tensors(run: RunState) -> dict[str, torch.Tensor]:
    data = {f"data.{k}": v for k, v in run.batches.state_dict().items()}
    return {**_rng_state(), **data}


def _state_json(run: RunState) -> dict[str, Any]:
    scheduler = None if run.scheduler is None else run.scheduler.state_dict()
    return {
        "format": FORMAT,
        "step": len(run.record["losses"]),
        "world": run.world,
        "tp": run.cfg.tp,
        "cp": run.cfg.cp,
        "ep": run.cfg.ep,
        "pp": _stages(run.cfg),
        "model": run.identity,
        "scheduler": scheduler,
        "record": run.record,
        "config": {"lr": run.cfg.lr, "lr_schedule": run.cfg.lr_schedule,
                   "warmup_steps": run.cfg.warmup_steps, "steps": run.cfg.steps},
    }  # fmt: skip


def _carry_steps(old: Path, new: Path) -> None:
    """Move the ``step-NNNNNN`` checkpoints of the replaced ``old`` into ``new`` (a rename each):
    the final save of a run with ``--save-every`` keeps them."""
    for _, child in _steps(old):
        child.rename(new / child.name)


def _saved_model(run: RunState) -> Any:
    """What ``save_checkpoint`` reads: an engine that holds its own layout (a pipeline's
    stages, DeepSpeed's ZeRO partitions, RoundPipe's optimizer copies), else the schedule's
    module (its tensor-parallel shards carry their specs, FSDP2's are DTensors)."""
    from ..checkpoints.model_layout import holds_layout

    return run.model if holds_layout(run.model) else run.module


def _save_full(path: Path, run: RunState, carry_steps: bool) -> None:
    """A full checkpoint: every rank joins the gather; each writes its RNG and data state."""
    import safetensors.torch

    from ..checkpoints import save_checkpoint  # deferred: safetensors loads only to save

    tmp = sibling(path, _TMP)
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    save_checkpoint(_saved_model(run), tmp, run.optimizer)  # collective: the full weights
    rank_file = tmp / f"train_state-rank{run.rank}.safetensors"
    tensors = {k: v.contiguous() for k, v in _rank_tensors(run).items()}
    safetensors.torch.save_file(tensors, str(rank_file), metadata={"format": "pt"})
    _barrier()
    if run.rank == 0:
        save_tokenizer = getattr(getattr(run.tokenizer, "tokenizer", None), "save_pretrained", None)
        if save_tokenizer is not None:  # a transformers tokenizer: from_pretrained(DIR) finds it
            save_tokenizer(str(tmp))
        write_json(tmp / STATE_FILE, _state_json(run))  # the marker, last
        replace_dir(tmp, path, old=_OLD, carry=_carry_steps if carry_steps else None)
    _barrier()


def _save_per_rank(path: Path, run: RunState) -> None:
    """Each rank's whole state (a DTensor as its own part) in ``path.rank<r>``."""
    from ..checkpoints import save_tree  # deferred: safetensors loads only to save

    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
        "data": run.batches.state_dict(),
        "rng": _rng_state(),
        "record": run.record,
        "identity": run.identity,
    }
    config = getattr(run.module, "config", None)
    save_tree(checkpoint_path(path, run.rank, run.world), state, config=config)


def save_run(path: Path, run: RunState, final: bool = True) -> None:
    """Save ``run`` into ``path`` (call on every rank); the final save of a run with
    ``--save-every`` keeps the ``step-NNNNNN`` checkpoints inside ``path``.

    Example:
        >>> # illustration: run is a live run's RunState, as in the module's example (seconds)
        >>> import transformers
        >>> run = None  # a RunState: slapo.train.loop.Runner(...).state(...)
        >>> save_run(Path("out"), run)  # doctest: +SKIP
        >>> transformers.AutoModelForCausalLM.from_pretrained("out")   # the trained weights  # doctest: +SKIP
    """
    if run.layout == "full":
        _save_full(path, run, carry_steps=final)
    else:
        _save_per_rank(path, run)


def prune_steps(save: str | Path, keep: int) -> list[Path]:
    """Remove all but the last ``keep`` ``step-NNNNNN`` checkpoints of ``save`` (rank 0);
    returns the removed directories.

    Example:
        >>> for step in (10, 20, 30):  # what --save-every left; the marker is written last
        ...     step_dir("steps", step).mkdir(parents=True)
        ...     _ = (step_dir("steps", step) / STATE_FILE).write_text("{}")
        >>> [p.name for p in prune_steps("steps", keep=2)]
        ['step-000010']
    """
    steps = _steps(Path(save))
    gone = [p for _, p in steps[: max(len(steps) - keep, 0)]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


# ----- loading ----------------------------------------------------------------------------------
def _load_full(path: Path, run: RunState) -> dict[str, Any]:
    import safetensors.torch

    from ..checkpoints import load_checkpoint

    state = read_state(path)
    load_checkpoint(_saved_model(run), path, run.optimizer)  # each rank keeps its slice of the full
    rank_file = path / f"train_state-rank{run.rank}.safetensors"
    if not rank_file.is_file():
        raise InputError(f"--resume {path} lacks {rank_file.name}: the checkpoint is damaged")
    tensors = safetensors.torch.load_file(str(rank_file))
    run.batches.load_state_dict(
        {k.removeprefix("data."): v for k, v in tensors.items() if k.startswith("data.")}
    )
    _set_rng_state(tensors)
    if run.scheduler is not None and state.get("scheduler") is not None:
        run.scheduler.load_state_dict(state["scheduler"])
    return {**new_record(), **state["record"]}


def _load_per_rank(path: Path, run: RunState) -> dict[str, Any]:
    """Restore what :func:`_save_per_rank` wrote (DTensor parts rebuilt like the live ones)."""
    from itertools import chain

    from ..checkpoints import dtensor_like, load_tree

    where = checkpoint_path(path, run.rank, run.world)
    try:
        state = load_tree(where)
    except CheckpointError as err:
        raise CheckpointError(f"--resume {where}: {err}") from err
    absent = [k for k in ("model", "optimizer", "data", "rng", "record") if k not in state]
    if absent:
        raise InputError(f"--resume {where} holds no {absent}: not a `slapo train --save` state")
    check_model(where, state.get("identity"), run.identity, run.cfg)
    try:
        live = run.model.state_dict()
        run.model.load_state_dict(
            {k: dtensor_like(v, live.get(k)) for k, v in state["model"].items()}
        )
        optim = state["optimizer"]
        saved_ids = chain.from_iterable(g["params"] for g in optim.get("param_groups", []))
        params = chain.from_iterable(g["params"] for g in run.optimizer.param_groups)
        by_id = dict(zip(saved_ids, params))
        for i, per_param in optim.get("state", {}).items():
            for key, value in per_param.items():  # exp_avg & co. are laid out like the parameter
                per_param[key] = dtensor_like(value, by_id.get(i))
        run.optimizer.load_state_dict(optim)
        run.batches.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        if run.scheduler is not None and state.get("scheduler") is not None:
            run.scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"--resume {where} does not fit this run (saved with other options?): {err}"
        ) from err
    return {**new_record(), **state["record"]}


def load_run(path: Path, run: RunState) -> dict[str, Any]:
    """Restore a checkpoint into ``run`` (weights, optimizer, LR schedule, data position, RNG
    streams); returns the record it saved. The checkpoint's own layout decides how it is read:
    a per-rank checkpoint an older Slapo wrote for FSDP or RoundPipe still resumes.

    Example:
        >>> # illustration: run is a live run's RunState and out/step-000020 its save at step 20
        >>> run = None  # a RunState: slapo.train.loop.Runner(...).state(...)
        >>> len(load_run(Path("out/step-000020"), run)["losses"])  # doctest: +SKIP
        20
    """
    return _load_full(path, run) if _is_full(path) else _load_per_rank(path, run)
