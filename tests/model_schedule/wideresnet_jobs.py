"""WideResNet under its tensor-parallel schedule, run in spawned gloo workers, against the same
model in one process: the loss, every gradient (whole for a replicated parameter, the slice for a
sharded one), the BatchNorm running statistics (likewise), an SGD loss curve, a checkpoint round
trip and meta-device consolidation."""

from __future__ import annotations

import copy

import torch
from torch import nn

import slapo
from dist_utils import run_checks
from slapo.checkpoints import full_state_dict
from slapo.initialization import materialize_module
from slapo.model_schedule import apply_schedule
from slapo.sharding import get_shard_spec
from slapo.vision import WideResNet, wideresnet_loss

DEPTH, WIDEN, BATCH, SIZE = 10, 2, 4, 8


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and class labels, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, SIZE, SIZE, generator=gen)
    return images, torch.randint(0, 10, (BATCH,), generator=gen)


def models(**knobs: object) -> tuple[nn.Module, nn.Module]:
    """The reference model and its scheduled copy, both in training mode."""
    torch.manual_seed(0)
    ref = WideResNet(depth=DEPTH, widen_factor=WIDEN).train()
    sch = apply_schedule(copy.deepcopy(ref), **knobs)
    model, _ = slapo.build(sch, init_weights=False)
    return ref, model


def expected(tensor: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` as this rank holds it: its slice where ``tensor`` is sharded."""
    spec = get_shard_spec(tensor)
    return full if spec is None else spec.local_slice(full)


def assert_state(model: nn.Module, ref: nn.Module, grads: bool = True) -> None:
    """Every gradient and buffer of ``model`` against ``ref``'s, all failures listed at once."""
    failures = []
    pairs = []
    if grads:
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            pairs.append((f"grad of {name}", param.grad, expected(param, ref_params[name].grad)))
    ref_bufs = dict(ref.named_buffers())
    pairs += [(n, b, expected(b, ref_bufs[n])) for n, b in model.named_buffers()]
    for name, got, want in pairs:
        try:
            torch.testing.assert_close(got, want)  # float32 defaults
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


def one_step(**knobs: object) -> None:
    """One forward and backward: the loss, the gradients and the running statistics."""
    ref, model = models(group=torch.distributed.group.WORLD, **knobs)
    images, labels = batch()
    ref_loss, loss = wideresnet_loss(ref, images, labels), wideresnet_loss(model, images, labels)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert_state(model, ref)
    sharded = {n for n, p in model.named_parameters() if get_shard_spec(p) is not None}
    # conv1, bn2 (weight, bias) and conv2 of each of the three blocks; nothing else.
    inner = ("conv1.weight", "bn2.weight", "bn2.bias", "conv2.weight")
    want = {f"{group}.0.{name}" for group in ("layer1", "layer2", "layer3") for name in inner}
    assert sharded == want, sorted(sharded ^ want)
    bn2 = model.layer2[0].bn2
    assert bn2.num_features == bn2.running_mean.numel() == 64 // torch.distributed.get_world_size()


def sgd_curve(steps: int = 5) -> None:
    """SGD with momentum: the loss curve and the final running statistics."""
    ref, model = models(group=torch.distributed.group.WORLD, ckpt_ratio=0.5)
    curves: list[list[float]] = [[], []]
    for mod, curve in ((ref, curves[0]), (model, curves[1])):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            loss = wideresnet_loss(mod, *batch(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]))
    assert_state(model, ref, grads=False)


def checkpoint_round_trip(directory: str) -> None:
    """A checkpoint of the unsharded model loads into the sharded one (each rank its slices of
    the parameters and running statistics) and gathers back to the same full state."""
    ref, model = models(group=torch.distributed.group.WORLD, ckpt_ratio=0.0)
    wideresnet_loss(ref, *batch()).backward()  # running statistics away from their initial values
    slapo.save_checkpoint(ref, directory)
    slapo.load_checkpoint(model, directory)
    assert_state(model, ref, grads=False)
    full, want = full_state_dict(model), ref.state_dict()
    assert full.keys() == want.keys()
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)


def meta_init() -> None:
    """Built on the meta device and consolidated: each rank holds its slices of the model one
    process materializes with the same seed (He-initialized convolutions, fresh running
    statistics), and the running statistics are still sharded."""
    with slapo.init_empty_weights():
        ref = WideResNet(depth=DEPTH, widen_factor=WIDEN)
        model = WideResNet(depth=DEPTH, widen_factor=WIDEN)
    torch.manual_seed(0)
    materialize_module(ref)
    sch = apply_schedule(model, group=torch.distributed.group.WORLD, ckpt_ratio=0.0)
    torch.manual_seed(0)
    slapo.consolidate_model(sch)
    model, _ = slapo.build(sch)
    assert get_shard_spec(model.layer2[0].bn2.running_var) is not None
    full, want = full_state_dict(model), ref.state_dict()
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    he_std = (2.0 / (64 * 9)) ** 0.5  # layer2.0.conv1: 64 outputs, 3x3, by fan out
    assert abs(want["layer2.0.conv1.weight"].std().item() / he_std - 1) < 0.1


def tp_job(rank: int, world: int, directory: str) -> dict[str, str | None]:
    """Every tensor-parallel check (``run_checks``): name -> traceback or None."""
    torch.set_num_threads(1)
    return run_checks(
        {
            "checkpoint round trip": lambda: checkpoint_round_trip(directory),
            "meta init": meta_init,
            "one step, recommended knobs": one_step,  # group= alone
            "one step, no checkpoint": lambda: one_step(ckpt_ratio=0.0),
            "one step, checkpointed": lambda: one_step(ckpt_ratio=1.0),
            "one step, selective checkpoint": lambda: one_step(
                ckpt_ratio=1.0, ckpt_policy="save_matmuls"
            ),
            "sgd loss curve": sgd_curve,
        }
    )
