"""Checkpoint jobs on pipeline layouts (run in spawned gloo workers): a checkpoint saved by the
stages equals the one process's, and one process's loads into the stages."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
for _extra in (TESTS, TESTS / "sharding", TESTS / "targets"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hf_models  # noqa: E402  (the path above)
import slapo  # noqa: E402
from slapo.checkpoints import load_checkpoint, save_checkpoint  # noqa: E402

LR = 1e-2
MICRO = 2


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def data(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        1, hf_models.VOCAB, (4, hf_models.SEQ), generator=torch.Generator().manual_seed(seed)
    )
    return ids, torch.roll(ids, -1, dims=1)


def make(seed: int = 0) -> torch.nn.Module:
    return hf_models.make("gpt2", seed=seed, dropout=0.0)


def single(seed: int = 0, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One process's model and AdamW after ``steps`` steps (the Adam state exists)."""
    model = make(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        ids, labels = data(step)
        loss_fn(model(input_ids=ids, use_cache=False).logits, labels).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def pipeline(mesh_shape: tuple[int, ...], names: tuple[str, ...], seed: int = 0):
    """gpt2 cut in two stages on a ``names`` mesh (tp: the family plan, vocab unsharded; dp:
    FSDP2 replicas, each holding a shard of its stages' parameters and Adam state)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = "tp" in names
    sch = slapo.create_schedule(make(seed), group=mesh["tp"] if tp else None)
    if tp:
        import plans

        plans.PLANS["gpt2"](sch, mesh["tp"].size(), vocab_parallel=False)
    sch["transformer.h.0"].cut_pipeline_stage()
    engine, opt = slapo.build(
        sch, target="pipeline", schedule="1F1B", num_microbatches=MICRO, loss_fn=loss_fn,
        example_inputs=data()[0], group=mesh, optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": LR}, data_parallel="fsdp",
    )  # fmt: skip
    return engine, opt


def train(engine, opt, steps: int) -> None:
    for step in range(steps):
        ids, labels = data(step)
        engine.step(ids, target=labels)
        opt.step()
        opt.zero_grad()


def assert_matches(engine, opt, model: torch.nn.Module, ref_opt: torch.optim.Optimizer) -> int:
    """Every tensor this rank holds, and its Adam state, equals the one process's (its slice)."""
    full = dict(model.named_parameters(remove_duplicate=False))
    checked = 0
    for name, p in engine.named_parameters():
        spec = engine.shard_specs[name]  # (FSDP2's DTensors carry none: the engine kept them)

        def mine(t: torch.Tensor, spec=spec) -> torch.Tensor:
            return spec.local_slice(t) if spec is not None else t

        assert torch.equal(whole(p.detach()), mine(full[name].detach())), name
        state, ref_state = opt.state[p], ref_opt.state[full[name]]
        assert set(state) == set(ref_state) and state, (name, set(state), set(ref_state))
        for key, value in state.items():
            want = ref_state[key] if value.dim() == 0 else mine(ref_state[key])
            assert torch.equal(whole(value), want), (name, key)
        checked += 1
    return checked


def whole(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor gathered over the data-parallel replicas (collective), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save_and_compare(
    rank: int, world: int, mesh_shape, names, out: str, single_dir: str | None
) -> dict:
    """Train the pipeline 2 steps and save it; load that into one process's model: equal. Then
    (given ``single_dir``) load that one-process checkpoint into a fresh pipeline: equal."""
    engine, opt = pipeline(mesh_shape, names)
    train(engine, opt, 2)
    save_checkpoint(engine, out, opt)
    model, ref_opt = single(seed=5, steps=0)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    load_checkpoint(model, out, ref_opt)
    saved = assert_matches(engine, opt, model, ref_opt)
    assert ref_opt.param_groups[0]["lr"] == LR
    if single_dir is None:
        return {"saved": saved, "loaded": saved}

    fresh, fresh_opt = pipeline(mesh_shape, names, seed=9)
    load_checkpoint(fresh, single_dir, fresh_opt)
    model, ref_opt = make(seed=5), None
    ref_opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    load_checkpoint(model, single_dir, ref_opt)
    loaded = assert_matches(fresh, fresh_opt, model, ref_opt)
    # the loaded pipeline trains on as the one process would: one more step, compared again
    train(fresh, fresh_opt, 1)
    dist.barrier()
    return {"saved": saved, "loaded": loaded}


def train_and_resume(rank: int, world: int, options: dict, save: str) -> dict:
    """`slapo train` twice in these processes (one process group, no relaunch): a run that saves
    every 2 steps, then a run resumed from its step 2. Returns both records."""
    from slapo.train import TrainConfig
    from slapo.train import train as slapo_train

    full = slapo_train(TrainConfig(**options, save=save, save_every=2))
    rest = slapo_train(TrainConfig(**options, resume=f"{save}/step-000002"))
    keys = ("losses", "lrs", "resumed_at", "peak_memory_mb", "estimated_peak_mb")
    return {"full": {k: full.get(k) for k in keys}, "rest": {k: rest.get(k) for k in keys}}
