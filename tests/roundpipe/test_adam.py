"""roundpipe.optim.Adam against torch.optim.Adam / AdamW, its build cache and its fused shadow pass.

The C++ kernel is compiled once for this module, by two processes at once into a fresh cache
directory (which is also the test of the build lock); every other test imports that build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from roundpipe import optim_builder
from roundpipe.optim import Adam

STEPS = 40
ATOL = 1e-6

_BUILD = (
    "from roundpipe.optim_builder import get_optim_function;"
    "f = get_optim_function('adam'); print('built', f.__name__)"
)


@pytest.fixture(scope="module")
def concurrent_build(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Build the kernel from two processes at once into an empty cache directory."""
    cache = tmp_path_factory.mktemp("extensions")
    env = {**os.environ, "ROUNDPIPE_EXTENSION_DIR": str(cache)}
    env.pop("ROUNDPIPE_DISABLE_CPP_OPTIM", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    return {"cache": cache, "codes": [p.returncode for p in procs], "outputs": outputs}


@pytest.fixture(scope="module", autouse=True)
def kernel(concurrent_build: dict) -> object:
    """The C++ step, imported from the module's build (no compile in this process)."""
    saved = os.environ.get("ROUNDPIPE_EXTENSION_DIR")
    os.environ["ROUNDPIPE_EXTENSION_DIR"] = str(concurrent_build["cache"])
    try:
        yield optim_builder.get_optim_function("adam")
    finally:
        if saved is None:
            os.environ.pop("ROUNDPIPE_EXTENSION_DIR", None)
        else:
            os.environ["ROUNDPIPE_EXTENSION_DIR"] = saved


def _params(seed: int = 0, complex_: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(257, 33), (5,), (1,), (4096,)]  # odd sizes exercise the vector tails
    ps = [torch.randn(s, generator=gen) for s in shapes]
    if complex_:
        ps.append(torch.randn(301, dtype=torch.complex64, generator=gen))
    return ps


def _leaves(tensors: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def _set_grads(step: int, *param_lists: list[torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for ps in zip(*param_lists, strict=True):
        g = torch.randn(ps[0].shape, dtype=ps[0].dtype, generator=gen)
        for p in ps:
            p.grad = g.clone()


def _assert_params_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL)


CONFIGS = {
    "default": {},
    "lr_1e-2": {"lr": 1e-2},
    "l2": {"lr": 1e-2, "weight_decay": 0.1},
    "adamw": {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
    "amsgrad": {"lr": 1e-2, "amsgrad": True},
    "maximize": {"lr": 1e-2, "maximize": True, "weight_decay": 0.05},
    "small_beta1": {"lr": 1e-2, "betas": (0.3, 0.9)},  # torch's other lerp formula
    "tensor_lr": {"lr": torch.tensor(0.01)},
    "tensor_betas": {"lr": torch.tensor([0.02]), "betas": (torch.tensor(0.8), torch.tensor(0.99))},
    "everything": {
        "lr": 3e-3,
        "betas": (0.85, 0.995),
        "eps": 1e-6,
        "weight_decay": 0.02,
        "amsgrad": True,
        "maximize": True,
        "decoupled_weight_decay": True,
    },
}


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_adam(name: str, implementation: str) -> None:
    kwargs = CONFIGS[name]
    init = _params(complex_=True)
    ours, ref = _leaves(init), _leaves(init)
    opt = Adam(ours, implementation=implementation, **kwargs)
    ref_opt = torch.optim.Adam(ref, **kwargs)
    for step in range(STEPS):
        _set_grads(step, ours, ref)
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)
    for p, q in zip(ours, ref, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=0, atol=ATOL)
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == STEPS


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
def test_matches_torch_adamw_and_param_groups(implementation: str) -> None:
    init = _params(seed=3)

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [
            {"params": ps[:2]},
            {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.0, "amsgrad": True},
        ]

    ours, ref = _leaves(init), _leaves(init)
    opt = Adam(
        groups(ours),
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        implementation=implementation,
    )
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        _set_grads(step, ours, ref)
        if step % 7 == 3:  # parameters without a gradient are skipped, as in torch
            ours[1].grad = ref[1].grad = None
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)


def test_non_contiguous_and_double_params_take_the_torch_path() -> None:
    init = [torch.randn(64, 48).t(), torch.randn(100, dtype=torch.float64)]
    ours, ref = _leaves(init), _leaves(init)
    ours[0] = torch.nn.Parameter(init[0].clone().t().contiguous().t())  # transposed storage
    ref[0] = torch.nn.Parameter(init[0].clone().t().contiguous().t())
    opt = Adam(ours, lr=1e-2, implementation="cpp")
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    for step in range(10):
        _set_grads(step, ours, ref)
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)


def test_closure_and_named_parameters() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref_model.load_state_dict(model.state_dict())
    opt = Adam(model.named_parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref_model.named_parameters(), lr=1e-2)
    x = torch.randn(32, 8)
    for _ in range(STEPS):
        for m, o in ((model, opt), (ref_model, ref_opt)):

            def closure(m: torch.nn.Module = m, o: torch.optim.Optimizer = o) -> torch.Tensor:
                o.zero_grad()
                loss = m(x).square().mean()
                loss.backward()
                return loss

            loss = o.step(closure)
        assert loss is not None
    _assert_params_close(list(model.parameters()), list(ref_model.parameters()))
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    assert sd["param_groups"] == ref_opt.state_dict()["param_groups"]


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_interchangeable(direction: str, amsgrad: bool) -> None:
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": amsgrad}
    init = _params(seed=5, complex_=True)
    first, reference = _leaves(init), _leaves(init)
    make_first = torch.optim.Adam if direction == "torch_to_ours" else Adam
    make_second = Adam if direction == "torch_to_ours" else torch.optim.Adam
    opt = make_first(first, **kwargs)
    ref_opt = torch.optim.Adam(reference, **kwargs)  # runs all steps uninterrupted
    for step in range(STEPS // 2):
        _set_grads(step, first, reference)
        opt.step()
        ref_opt.step()
    saved = opt.state_dict()
    # a fresh optimizer of the other kind, on fresh parameters, continues from the saved state
    second = _leaves([p.detach() for p in first])
    opt2 = make_second(second, lr=0.5)  # hyperparameters come from the state dict
    opt2.load_state_dict(saved)
    assert opt2.state_dict()["param_groups"] == saved["param_groups"]
    for step in range(STEPS // 2, STEPS):
        _set_grads(step, second, reference)
        opt2.step()
        ref_opt.step()
    _assert_params_close(second, reference)


def test_state_dict_round_trip_through_torch_save(tmp_path: Path) -> None:
    init = _params(seed=6)
    ours, ref = _leaves(init), _leaves(init)
    opt, ref_opt = Adam(ours, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)
    for step in range(5):
        _set_grads(step, ours, ref)
        opt.step()
        ref_opt.step()
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    opt = Adam(ours, lr=1e-2)
    opt.load_state_dict(torch.load(tmp_path / "adam.pt"))
    for step in range(5, 10):
        _set_grads(step, ours, ref)
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
@pytest.mark.parametrize(
    ("grad_dtype", "shadow_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_shadow_pass_equals_adam_then_cast(
    grad_dtype: torch.dtype, shadow_dtype: torch.dtype, implementation: str
) -> None:
    init = _params(seed=7)
    masters, ref = _leaves(init), _leaves(init)
    shadows = [m.detach().to(shadow_dtype, copy=True) for m in masters]
    opt = Adam(masters, lr=1e-2, weight_decay=0.01, implementation=implementation)
    for m, s in zip(masters, shadows, strict=True):
        opt.register_shadow(m, s)
    ref_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        for m, s, r in zip(masters, shadows, ref, strict=True):
            low = (torch.randn(m.shape, generator=gen) * 10).to(grad_dtype)
            if grad_dtype == torch.float32:
                m.grad = low.clone()
            elif grad_dtype == shadow_dtype:
                s.grad = low  # the model copy's own low-precision gradient
            else:
                m.grad_dtype = None  # torch 2.13: a master may accept a bf16 .grad directly
                m.grad = low
            r.grad = low.float()  # torch: widen the gradient, step, then cast (3 passes)
        opt.step()
        ref_opt.step()
        for m, s in zip(masters, shadows, strict=True):
            assert torch.equal(s, m.detach().to(shadow_dtype))  # bit-exact cast, in the same pass
        opt.zero_grad()
        assert all(s.grad is None and m.grad is None for m, s in zip(masters, shadows, strict=True))
    _assert_params_close(masters, ref)
    for s, r in zip(shadows, ref, strict=True):
        # one rounding of a master that may differ from torch's in the last fp32 bit
        torch.testing.assert_close(s.float(), r.detach().to(shadow_dtype).float())


def test_bf16_cast_rounds_like_torch(kernel: object) -> None:
    """Round-to-nearest-even, ties, infinities and NaN, as Tensor.to(torch.bfloat16)."""
    specials = torch.tensor(
        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38, float("inf"), float("-inf"), 1e-40]
    )
    values = torch.cat([specials, torch.randn(5000) * 100, torch.tensor([float("nan")])])
    master = torch.nn.Parameter(values.clone())
    shadow = torch.empty_like(values, dtype=torch.bfloat16)
    opt = Adam([master], lr=0.0, implementation="cpp")  # lr 0: the step leaves master as is
    opt.register_shadow(master, shadow)
    master.grad = torch.zeros_like(values)
    opt.step()
    expected = values.to(torch.bfloat16)
    assert torch.equal(shadow[:-1].view(torch.int16), expected[:-1].view(torch.int16))
    assert torch.isnan(shadow[-1])


def test_fallback_when_cpp_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_DISABLE_CPP_OPTIM", "1")
    with pytest.raises(optim_builder.OptimBuildError, match="DISABLE"):
        optim_builder.get_optim_function("adam")
    with pytest.raises(optim_builder.OptimBuildError):
        Adam([torch.nn.Parameter(torch.zeros(2))], implementation="cpp")
    init = _params(seed=8)
    ours, ref = _leaves(init), _leaves(init)
    monkeypatch.setattr(Adam, "_warned", False, raising=False)
    opt = Adam(ours, lr=1e-2, amsgrad=True)  # "auto": warns once, then steps in PyTorch
    ref_opt = torch.optim.Adam(ref, lr=1e-2, amsgrad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _set_grads(step, ours, ref)
            opt.step()
            ref_opt.step()
    assert sum("PyTorch path" in str(w.message) for w in caught) == 1
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)  # the fallback is torch's own arithmetic, bit for bit


def test_fallback_when_no_compiler_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDPIPE_EXTENSION_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(optim_builder, "loaded_optim_functions", {})
    monkeypatch.setattr(optim_builder, "_failed", {})
    monkeypatch.setattr(Adam, "_warned", False)
    p, q = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
    opt, ref = Adam([p], lr=0.1), torch.optim.Adam([q], lr=0.1)
    with pytest.warns(UserWarning, match="PyTorch path.*failed"):
        for i in range(5):
            p.grad = torch.full((10,), float(i + 1))
            q.grad = p.grad.clone()
            opt.step()
            ref.step()
    assert torch.equal(p, q)
    with pytest.raises(optim_builder.OptimBuildError, match="failed"):
        optim_builder.get_optim_function("adam")  # the failure is remembered, not retried


def test_concurrent_builds_both_succeed(concurrent_build: dict) -> None:
    assert concurrent_build["codes"] == [0, 0], concurrent_build["outputs"]
    assert all("built adam" in out for out in concurrent_build["outputs"])
    built = [p for p in concurrent_build["cache"].iterdir() if p.is_dir()]
    assert len(built) == 1  # one build, keyed by the source and CPU hash
    assert (built[0] / f"{built[0].name}.so").is_file()
    assert optim_builder.get_cpu_flags_hash() == optim_builder.get_cpu_flags_hash()


def test_step_releases_the_gil() -> None:
    """A Python thread sees the parameter half-updated, i.e. it ran while the kernel did."""
    n = 1 << 24
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = Adam([param], lr=0.1, implementation="cpp")
    opt.step()  # allocate the state outside the observed steps
    probes = torch.linspace(0, n - 1, 64).long()
    partial = False
    for _ in range(5):
        before = param[probes].clone()
        counts: list[int] = []
        stop = threading.Event()

        def watch(before: torch.Tensor = before, counts: list[int] = counts, stop=stop) -> None:
            while not stop.is_set():
                counts.append(int((param.detach()[probes] != before).sum()))

        watcher = threading.Thread(target=watch)
        watcher.start()
        opt.step()
        stop.set()
        watcher.join()
        assert bool((param[probes] != before).all())  # every probe moved by the end of the step
        if any(0 < c < len(probes) for c in counts):
            partial = True
            break
    assert partial


def test_bad_inputs_raise_like_torch() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    bad = [
        ({"lr": -1.0}, ValueError, "Invalid learning rate"),
        ({"eps": -1e-8}, ValueError, "Invalid epsilon"),
        ({"betas": (1.0, 0.999)}, ValueError, "index 0"),
        ({"betas": (0.9, -0.1)}, ValueError, "index 1"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"betas": (torch.tensor(0.9), 0.999)}, ValueError, "both floats or both Tensors"),
        ({"lr": torch.tensor([0.1, 0.2])}, ValueError, "1-element"),
        ({"lr": torch.tensor(0.1), "foreach": True}, ValueError, "lr as a Tensor"),
        ({"fused": True, "foreach": True}, RuntimeError, "cannot be `True` together"),
        ({"differentiable": True}, NotImplementedError, "differentiable"),
        ({"implementation": "gpu"}, ValueError, "implementation"),
    ]
    for kwargs, exc, match in bad:
        with pytest.raises(exc, match=match):
            Adam(p, **kwargs)
        if exc is ValueError and "implementation" not in kwargs:
            with pytest.raises(exc, match=match):
                torch.optim.Adam(p, **kwargs)  # the same error as torch
    with pytest.raises(ValueError, match="empty parameter list"):
        Adam([])

    opt = Adam(p)
    with pytest.raises(ValueError, match="not a parameter"):
        opt.register_shadow(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        opt.register_shadow(p[0], torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot shadow"):
        opt.register_shadow(p[0], torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError):
        opt.register_shadow(p[0], [0.0, 0.0, 0.0])  # type: ignore[arg-type]
    p[0].grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_unknown_optimizer_function() -> None:
    with pytest.raises(ValueError, match="unknown optimizer function"):
        optim_builder.load_optim_function("no_such_optimizer")


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_zero_element_parameters_step_like_torch(implementation: str, amsgrad: bool) -> None:
    """torch's Adam accepts parameters with no elements (and counts their steps)."""
    init = [*_params(seed=7), torch.zeros(0), torch.zeros(4, 0)]
    ours, ref = _leaves(init), _leaves(init)
    opt = Adam(ours, lr=1e-2, amsgrad=amsgrad, implementation=implementation)
    ref_opt = torch.optim.Adam(ref, lr=1e-2, amsgrad=amsgrad)
    shadow = torch.zeros(0, dtype=torch.bfloat16)  # an empty shadow has no storage either
    opt.register_shadow(ours[-2], shadow)
    for step in range(3):
        _set_grads(step, ours, ref)
        opt.step()
        ref_opt.step()
    _assert_params_close(ours, ref)
    for p, q in zip(ours[-2:], ref[-2:], strict=True):
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 3
        assert opt.state[p]["exp_avg"].shape == q.shape


def test_kernel_accepts_empty_rows_without_addresses(kernel: object) -> None:
    """An empty tensor reports address 0: the kernel must skip it, not refuse the whole step."""
    p = torch.ones(5)
    grad, exp_avg, exp_avg_sq = torch.ones(5), torch.zeros(5), torch.zeros(5)
    row_ok = [
        p.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0,
        0,
        5,
        1,
        0,
    ]
    row_empty = [0, 0, 0, 0, 0, 0, 0, 1, 2]  # no addresses, a bf16 shadow dtype code, 0 elements
    table = torch.tensor([row_empty, row_ok], dtype=torch.int64)
    steps = torch.tensor([[0.1, 1.0], [0.1, 1.0]], dtype=torch.float64)  # step size, sqrt(bc2)
    kernel(
        table.data_ptr(), steps.data_ptr(), 2, 0.9, 0.999, 0.0, 1.0, 1e-8, False, False, False, 1
    )
    assert torch.all(p < 1.0)  # the non-empty row was still updated
    bad = torch.tensor([[0, 0, 0, 0, 0, 0, 3, 1, 0]], dtype=torch.int64)  # 3 elements, no address
    with pytest.raises(ValueError, match="null tensor address"):
        kernel(
            bad.data_ptr(), steps.data_ptr(), 1, 0.9, 0.999, 0.0, 1.0, 1e-8, False, False, False, 1
        )
