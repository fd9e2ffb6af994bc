"""User guide: Training Loop, Creating an Optimizer and GradScaler, as flows.

Each test runs a page's code shape on CPU virtual devices (instead of CUDA GPUs), with random
weights and synthetic batches (instead of downloaded data), and checks it against the same loop
in plain PyTorch (:class:`guide_reference.PlainTrainer`: one-step-stale values for the
asynchronous ``model.step``). Tolerances: float32 runs within rtol 1e-5 / atol 1e-6, float16
models (float32 optimizer copies) within rtol 1e-3 / atol 1e-4 unless stated.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from guide_reference import PlainTrainer, assert_grads, assert_params, wrap
from torch import nn

from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_stream
from roundpipe.optim import Adam

N_MB = 2


class TokenStem(nn.Module):
    """First layer taking the keyword inputs of a Hugging Face style model."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1).to(self.emb.weight.dtype)
        return h.sum(dim=1)


class KwargsSequential(nn.Sequential):
    """A Sequential whose first layer takes keyword arguments too (RoundPipe calls it so)."""

    def forward(self, *args, **kwargs):
        h = self[0](*args, **kwargs)
        for layer in self[1:]:
            h = layer(h)
        return h


def _token_classifier(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return KwargsSequential(
        TokenStem(32, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)
    )


def _classifier(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def _token_batch(g: torch.Generator, n: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, 32, (n, 6), generator=g)
    mask = (torch.rand(n, 6, generator=g) > 0.2).long()
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 4, (n,), generator=g)


def test_training_loop_page(two_devices, tmp_path):
    """forward_backward's arguments (input_kwargs, label, loss_fn, return_outputs, run_config),
    the asynchronous step, synchronize() before inspecting gradients and saving a checkpoint,
    evaluation with forward(), and forward() + loss.backward()."""
    net = _token_classifier()
    ref = PlainTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.5), is_async=True)
    model = wrap(copy.deepcopy(net), num_microbatch=N_MB)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()

    def loss_fn(outputs, labels):
        return criterion(outputs, labels) / N_MB

    def step_fn():
        optimizer.step()
        optimizer.zero_grad()

    g = torch.Generator().manual_seed(1)
    for it in range(3):
        inputs, labels = _token_batch(g)
        loss, outputs = model.forward_backward(
            input_kwargs=inputs,
            label=labels,
            loss_fn=loss_fn,
            return_outputs=True,
            run_config=RoundPipeRunConfig(),
        )
        ref_outputs: list[torch.Tensor] = []
        ref_loss = ref.forward_backward((), inputs, labels, loss_fn, N_MB, ref_outputs)
        assert_params([loss, outputs], [ref_loss, torch.cat(ref_outputs)], f"iteration {it}")
        model.step(step_fn)
        ref.step()

    # 3. inspecting gradients: a forward_backward without a step, then synchronize()
    inputs, labels = _token_batch(g)
    model.forward_backward(input_kwargs=inputs, label=labels, loss_fn=loss_fn)
    ref.forward_backward((), inputs, labels, loss_fn, N_MB)
    model.synchronize()
    plain = ref.synchronized()
    assert_params(model.model.parameters(), plain.parameters(), "parameters after synchronize")
    assert_grads(model.model, plain, "accumulated gradients after synchronize")

    # 2. saving a checkpoint
    torch.save(model.model.state_dict(), tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt")
    assert_params(saved.values(), plain.state_dict().values(), "checkpoint")

    # evaluation: forward() under no_grad, both calling conventions
    model.eval()
    plain.eval()
    with torch.no_grad():
        out = model(**inputs)
        out2 = model.forward(**inputs, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
    assert not model.model.training
    model.train()
    assert_params([out, out2], [plain(**inputs)] * 2, "evaluation outputs")

    # forward() output supports backward as usual (gradients add to the ones above)
    plain.train()
    output = model(**inputs, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
    criterion(output, labels).backward()
    criterion(plain(**inputs), labels).backward()
    assert_grads(model.model, plain, "gradients after forward() + backward()")


def _scaled_reference_step(ref_scaler, clip: bool):
    def step_fn(opt):
        if clip:
            ref_scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], max_norm=1.0)
        ref_scaler.step(opt)
        opt.zero_grad()

    return step_fn


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("pattern", ["basic", "scaler", "clip"])
def test_step_fn_patterns(two_devices, pattern, is_async):
    """model.step's step_fn patterns: plain, with GradScaler, with unscale_ + gradient clipping;
    inside step_fn model.parameters() is the optimizer's parameters. Losses printed as the page
    computes them (loss.item() / scaler.get_scale() after update) and the final parameters equal
    plain PyTorch with torch.amp.GradScaler; the scale grows every step (growth_interval=1)."""
    net = _classifier()
    ref = PlainTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.2), is_async=is_async)
    model = wrap(copy.deepcopy(net), num_microbatch=N_MB)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.2)
    use_scaler = pattern != "basic"
    scaler = GradScaler(init_scale=2.0**4, growth_interval=1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    criterion = nn.CrossEntropyLoss()
    seen: list[list[int]] = []

    def step_fn():
        seen.append([id(p) for p in model.parameters()])  # redirected to the optimizer's
        if pattern == "basic":
            optimizer.step()
        else:
            if pattern == "clip":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], max_norm=1.0)
            scaler.step(optimizer)
        optimizer.zero_grad()

    g = torch.Generator().manual_seed(2)
    for it in range(4):
        x = torch.randn(4, 8, generator=g) * 4  # large gradients: clipping is active
        y = torch.randint(0, 4, (4,), generator=g)
        if use_scaler:
            loss_fn = lambda o, t, s=scaler: s.scale(criterion(o.float(), t)) / N_MB  # noqa: E731
            ref_fn = lambda o, t: ref_scaler.scale(criterion(o.float(), t)) / N_MB  # noqa: E731
        else:
            loss_fn = ref_fn = lambda o, t: criterion(o, t) / N_MB  # noqa: E731
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        ref_loss = ref.forward_backward((x,), {}, y, ref_fn, N_MB)
        model.step(step_fn, is_async=is_async)
        if use_scaler:
            ref_scale = ref_scaler.get_scale()  # the scale this step's losses were scaled by
            ref.step(_scaled_reference_step(ref_scaler, pattern == "clip"))
            ref_scaler.update()
            scaler.update()
            real, ref_real = loss.item() / scaler.get_scale(), ref_loss.item() / ref_scale
        else:
            ref.step()
            real, ref_real = loss.item(), ref_loss.item()
        assert real == pytest.approx(ref_real, rel=1e-5), f"printed loss at iteration {it}"
    model.synchronize()
    assert_params(model.model.parameters(), ref.synchronized().parameters(), "parameters")
    optim_ids = [id(p) for p in model.optim_parameters()]
    assert seen and all(s == optim_ids for s in seen)
    if use_scaler:
        assert scaler.get_scale(up_to_date=True) == ref_scaler.get_scale() == 2.0**8


def test_optimizer_page(two_devices):
    """OptimizerCtx redirects model.parameters() (and parameter groups) to the float32 optimizer
    copies of a float16 model; RoundPipe's Adam (weight decay, decoupled) and torch's fused AdamW
    train like torch's optimizers on plain float32 master weights."""
    net = _classifier().to(torch.float16)
    model = RoundPipe(copy.deepcopy(net), optim_dtype=torch.float32, pin_model="off")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with OptimizerCtx():
        inside = list(model.parameters())
        named = dict(model.named_parameters())
        grouped = torch.optim.AdamW([{"params": model.parameters(), "lr": 1e-4}])
    assert [id(p) for p in inside] == [id(p) for p in model.optim_parameters()]
    assert {p.dtype for p in inside} == {torch.float32}
    assert list(named) == [n for n, _ in model.optim_named_parameters()]
    assert [id(p) for p in grouped.param_groups[0]["params"]] == [id(p) for p in inside]

    criterion = nn.CrossEntropyLoss()
    kinds = {
        "adam_wd": (
            lambda ps: Adam(ps, lr=1e-2, weight_decay=0.01),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
        ),
        "adam_decoupled": (
            lambda ps: Adam(ps, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        ),
        "torch_fused": (
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        ),
    }
    g = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(6, 8, generator=g).half(), torch.randint(0, 4, (6,), generator=g))
        for _ in range(3)
    ]
    for name, (ours, theirs) in kinds.items():
        model = RoundPipe(
            copy.deepcopy(net),
            optim_dtype=torch.float32,
            pin_model="off",
            model_run_config=RoundPipeRunConfig(num_microbatch=3),
        )
        with OptimizerCtx():
            optimizer = ours(model.parameters())
        ref = PlainTrainer(net, theirs, optim_dtype=torch.float32)

        def loss_fn(out, y):
            return criterion(out.float(), y) / 3

        for x, y in data:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            ref_loss = ref.forward_backward((x,), {}, y, loss_fn, 3)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-4)
            model.step(lambda opt=optimizer: (opt.step(), opt.zero_grad()))
            ref.step()
        model.synchronize()
        assert_params(model.optim_parameters(), ref.master, f"{name} optimizer copies", 1e-4, 1e-5)
        assert_params(
            model.model.parameters(), ref.synchronized().parameters(), f"{name} model", 1e-3, 1e-3
        )


# -- GradScaler ---------------------------------------------------------------------------------
def _page_scaler_loop(
    net: nn.Module, data: list, order: str, init_scale: float
) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """The GradScaler page's loop (float16 model, float32 Adam, asynchronous step), printing
    ``loss.item() / scaler.get_scale()`` right after ``scaler.update()``.

    ``order`` forces when that read happens relative to the optimizer thread (no API the page
    uses): ``"held"`` reads while the thread has not started the step, ``"drained"`` once it
    finished the step and the update, ``"free"`` leaves it to chance. Returns the printed
    values, the scales read and the final optimizer values.
    """
    model = RoundPipe(
        copy.deepcopy(net),
        optim_dtype=torch.float32,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=N_MB),
    )
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=init_scale, growth_interval=1)
    criterion = nn.CrossEntropyLoss()
    printed, scales = [], []
    for data_, labels in data:
        loss = model.forward_backward(
            input_args=(data_.to(torch.float16),),
            label=labels,
            loss_fn=lambda outputs, labels: scaler.scale(criterion(outputs.float(), labels)) / N_MB,
        )
        release = None
        if order == "held":  # the optimizer thread waits until after the read
            release = optim_stream_hold()
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()
        if order == "drained":
            optim_stream.synchronize_optim()
        scales.append(scaler.get_scale())
        printed.append(loss.item() / scaler.get_scale())
        if release is not None:
            release.set()
    model.synchronize()
    return printed, scales, [p.detach().clone() for p in model.optim_parameters()]


def optim_stream_hold():
    """Block the optimizer thread until the returned event is set."""
    release = threading.Event()
    optim_stream.launch_optim_kernel(release.wait, 30)
    return release


def test_grad_scaler_page_values_do_not_depend_on_timing(two_devices):
    """What the page prints after the asynchronous scaler.update() is the same whatever the
    optimizer thread's progress (held, drained, free; several runs) and equals the synchronous
    computation: plain PyTorch with a float32 master copy, the same Adam, one step stale, and
    torch.amp.GradScaler's scale sequence (growth every step, backoff on float16 overflow)."""
    net = _classifier(width=32).to(torch.float16)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 8, generator=g) * 3, torch.randint(0, 4, (4,), generator=g))]
    data += [(torch.randn(4, 8, generator=g) * 3, torch.randint(0, 4, (4,), generator=g))]
    data = data * 5  # 10 iterations
    init_scale = 2.0**17

    runs = [
        _page_scaler_loop(net, data, order, init_scale)
        for order in ("held", "drained", "free", "held", "free")
    ]
    first = runs[0]
    for printed, scales, params in runs[1:]:
        assert printed == first[0] and scales == first[1]
        for a, b in zip(params, first[2]):
            assert torch.equal(a, b)

    # the synchronous computation
    ref = PlainTrainer(net, lambda ps: Adam(ps, lr=1e-3), optim_dtype=torch.float32)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    criterion = nn.CrossEntropyLoss()
    want_printed, want_scales = [], []
    for x, y in data:
        loss = ref.forward_backward(
            (x.to(torch.float16),),
            {},
            y,
            lambda out, t: ref_scaler.scale(criterion(out.float(), t)) / N_MB,
            N_MB,
        )
        used = ref_scaler.get_scale()
        ref.step(lambda opt: (ref_scaler.step(opt), opt.zero_grad()))
        ref_scaler.update()
        want_scales.append(used)
        want_printed.append(loss.item() / used)
    assert first[1] == want_scales
    assert any(b < a for a, b in zip(want_scales, want_scales[1:])), "no overflow backoff"
    assert any(b > a for a, b in zip(want_scales, want_scales[1:])), "no growth"
    assert first[0] == pytest.approx(want_printed, rel=1e-3)
    assert_params(first[2], ref.master, "optimizer copies", 1e-3, 1e-4)


def test_grad_scaler_reads_follow_program_order(two_devices):
    """Setters and getters on the main thread see the calls made before them, while the
    optimizer thread is still busy; update(is_async=False) and get_scale(up_to_date=True)
    return the new scale, state_dict() the scale the next step uses."""
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    release = optim_stream_hold()
    try:
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(5)
        assert scaler.get_growth_factor() == 3.0
        assert scaler.get_backoff_factor() == 0.25
        assert scaler.get_growth_interval() == 5
        scaler.update(new_scale=8.0)
        assert scaler.get_scale() == 4.0  # the step in progress keeps its scale
    finally:
        release.set()
    assert scaler.get_growth_factor(up_to_date=True) == 3.0
    assert scaler.scale(torch.tensor(1.0)).item() == 8.0  # the next step adopts the update
    assert scaler.get_scale() == 8.0
    scaler.update(new_scale=16.0, is_async=False)
    assert scaler.get_scale() == 16.0
    assert scaler.state_dict()["scale"] == 16.0
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)


def test_update_inside_step_fn_is_refused(two_devices):
    model = wrap(_classifier(), num_microbatch=N_MB)
    scaler = GradScaler()
    model(torch.randn(4, 8)).sum().backward()
    model.step(lambda: scaler.update())
    with pytest.raises(RuntimeError, match="main thread"):
        model.synchronize()
