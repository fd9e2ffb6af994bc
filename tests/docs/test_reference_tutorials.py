"""Slapo's four published tutorial scripts run unchanged against this Slapo.

The scripts are read from the reference copy (``SLAPO_REFERENCE_TUTORIALS``, default
/work/shared/reference/slapo-tutorials) and run, each in its own process, by this file run as a
script: ``python test_reference_tutorials.py <name>``. That runner changes nothing in a script;
it substitutes only what a test machine lacks (the quick start's ``AutoConfig.from_pretrained
("bert-large-uncased")`` becomes a small BERT config, offline), records each model handed to
``slapo.create_schedule`` (a copy of it, unscheduled) and each model ``slapo.build`` returns, and
after the script checks what the script did: what the built models compute and print against the
unscheduled models (output, loss and every gradient), and the structure each tutorial describes.
Each check prints a "CHECKED <what>" line; a failed one exits non-zero.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

REFERENCE = Path(
    os.environ.get("SLAPO_REFERENCE_TUTORIALS", "/work/shared/reference/slapo-tutorials")
)
ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120  # seconds: each script takes a few; far below a hung process's forever


# ---- the runner (in the subprocess) -------------------------------------------------------------
@dataclass
class Scheduled:
    """A model handed to ``slapo.create_schedule``: an unscheduled copy and its names."""

    reference: nn.Module
    names: dict[int, str]  # data_ptr of each original parameter -> its name


@dataclass
class Built:
    """A model returned by ``slapo.build`` and its first call: input, output, what it printed."""

    model: nn.Module
    calls: list[tuple[tuple, Any, str]] = field(default_factory=list)


SCHEDULED: list[Scheduled] = []
BUILT: list[Built] = []


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, real: Any) -> None:
        self.real, self.kept = real, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()


def _record_calls(built: Built) -> None:
    """Keep the built model's first call and what it printed (stdout) meanwhile."""
    state: dict[str, Any] = {}

    def before(mod: nn.Module, args: tuple) -> None:
        if not built.calls and "tee" not in state:
            state["real"], state["tee"] = sys.stdout, _Tee(sys.stdout)
            sys.stdout = state["tee"]

    def after(mod: nn.Module, args: tuple, out: Any) -> None:
        if "tee" in state and not built.calls:
            sys.stdout = state["real"]
            built.calls.append((args, out, state.pop("tee").kept.getvalue()))

    built.model.register_forward_pre_hook(before)
    built.model.register_forward_hook(after)


def _install_recorders() -> None:
    import slapo

    create_schedule, build = slapo.create_schedule, slapo.build

    def recording_create_schedule(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        names = {p.data_ptr(): n for n, p in model.named_parameters()}
        SCHEDULED.append(Scheduled(copy.deepcopy(model), names))
        return create_schedule(model, *args, **kwargs)

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        result = build(*args, **kwargs)
        built = Built(result[0] if isinstance(result, tuple) else result)
        _record_calls(built)
        BUILT.append(built)
        return result

    slapo.create_schedule = recording_create_schedule
    slapo.build = recording_build


def small_bert_config() -> Any:
    import transformers

    return transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64, type_vocab_size=2,
    )  # fmt: skip


def _offline_auto_config() -> list[str]:
    """``AutoConfig.from_pretrained`` returns a small BERT config offline; returns the names
    the script asked for."""
    import transformers

    asked: list[str] = []

    def from_pretrained(cls: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(name)
        return small_bert_config()

    transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)
    return asked


def checked(what: str) -> None:
    print(f"CHECKED {what}", flush=True)


def _name_in_reference(
    name: str, param: torch.Tensor, sch: Scheduled, prefix: str, known: set[str]
) -> str:
    """The reference's name for a built model's parameter: its own name where the reference has
    it (``known``), else the name its storage had before scheduling (``fuse`` moves modules)."""
    by_ptr = sch.names.get(param.data_ptr(), "")
    if name not in known and by_ptr.startswith(prefix):
        return by_ptr[len(prefix) :]
    return name


def assert_same_step(
    built: nn.Module, ref: nn.Module, inputs: tuple, sch: Scheduled, prefix: str = "", **tol: Any
) -> None:
    """``built`` computes what ``ref`` does: output, loss and every parameter's gradient."""
    outs = []
    for model in (built, ref):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = model(*inputs)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).pow(2).mean()
        loss.backward()
        outs.append((out.detach(), loss.detach()))
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], **tol)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    got = {
        _name_in_reference(n, p, sch, prefix, set(ref_grads)): p.grad
        for n, p in built.named_parameters()
    }
    assert sorted(got) == sorted(ref_grads), (sorted(got), sorted(ref_grads))
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got[name], grad, **tol, msg=lambda m, n=name: f"{n}: {m}")


def check_debug_print(g: dict[str, Any]) -> None:
    assert len(SCHEDULED) == 2 and len(BUILT) == 2, (len(SCHEDULED), len(BUILT))
    right, wrong = zip(SCHEDULED, BUILT, strict=True)
    for (sch, built), kind in ((right, "MLPWithPrint"), (wrong, "MLPWithWrongPrint")):
        assert type(sch.reference).__name__ == kind
        assert len(built.calls) == 1, f"{kind}: the built model was not called"
        args, out, printed = built.calls[0]
        ref_print = io.StringIO()
        with contextlib.redirect_stdout(ref_print):  # with autograd: grad_fn= is printed too
            ref_out = sch.reference(*args)
        torch.testing.assert_close(out, ref_out)
        if kind == "MLPWithPrint":
            # The built (traced) model prints, at run time, what the unscheduled model prints.
            assert printed == ref_print.getvalue(), (printed, ref_print.getvalue())
            linear1 = sch.reference.linear1(args[0])
            assert printed == f"linear1 shape\n {linear1.shape} \nvalue\n {linear1}\n", printed
            checked(f"{kind} prints linear1's shape and values, as the unscheduled model does")
        else:
            # The tutorial's wrong usage: strings formatted while tracing print the proxies.
            assert "print1: Proxy(linear1)" in printed and "print2: Proxy(" in printed, printed
            checked(f"{kind} prints the tracer's proxies, as the tutorial explains")
        assert_same_step(built.model, sch.reference, args, sch)
        checked(f"{kind}: built model's output, loss and gradients")


def check_mlp_multi_gpu(g: dict[str, Any]) -> None:
    import torch.distributed as dist

    assert dist.get_world_size() == 1
    (sch,), (built,) = SCHEDULED, BUILT
    model = g["opt_model"]
    assert built.model is model
    calls = [n.target for n in model.graph.nodes if n.op == "call_module"]
    assert "BiasGeLU_0" in calls and "linear2" in calls, calls
    assert isinstance(model.get_submodule("BiasGeLU_0"), torch.jit.ScriptModule)
    for name in ("linear1.weight", "linear1.bias", "linear2.weight"):
        param = model.get_parameter(name)
        assert param.orig_shape == sch.reference.get_parameter(name).shape  # one rank: whole
    checked("sharded, synced, decomposed and fused BiasGeLU_0 MLP")
    x = torch.randn(2, 8, 1024)
    # matmul + add and a scripted GELU against addmm and GELU: float32 tolerance at width 1024
    assert_same_step(model, sch.reference, (x,), sch, rtol=1e-4, atol=1e-5)
    checked("built MLP's output, loss and gradients")


def check_attention(g: dict[str, Any]) -> None:
    from torch import fx

    from slapo.op.attention import FlashAttentionOp

    (sch,), (built,) = SCHEDULED, BUILT
    opt_model = g["opt_model"]
    assert built.model is opt_model
    attn = opt_model.self_attn
    assert isinstance(attn, fx.GraphModule)
    assert isinstance(attn.FusedQKV_0, g["FusedQKV"]) and attn.FusedQKV_0 is g["fused_qkv"]
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(attn.FlashAttentionOp_0, FlashAttentionOp)
    (flash,) = [n for n in attn.graph.nodes if n.target == "FlashAttentionOp_0"]
    assert flash.kwargs == {"attention_mask": None, "p": 0.1}, flash.kwargs
    assert len(flash.args) == 3  # q, k and v from the fused projection
    checked("self_attn: FusedQKV_0 and FlashAttentionOp_0 with the concrete arguments")

    proj = opt_model.proj
    calls = [n.target for n in proj.graph.nodes if n.op in ("call_module", "call_function")]
    assert "FusedLayerNorm_0" in calls, f"the layer-norm pattern was not fused: {calls}"
    assert isinstance(proj.FusedLayerNorm_0, torch.jit.ScriptModule)
    assert not hasattr(proj, "layer_norm") and not hasattr(proj, "dropout")
    checked("proj: decomposed dense, FusedLayerNorm_0")
    # Only Projection runs eagerly as written (the tutorial's SelfAttention and FusedQKV are
    # illustrations: torch.sqrt of an int, a split into size-1 chunks): compare it, in eval
    # mode (its dropout and the fused one draw different masks).
    ref = sch.reference.proj.eval()
    inputs = (torch.randn(2, 4, 1024), torch.randn(2, 4, 1024))
    assert_same_step(proj.eval(), ref, inputs, sch, prefix="proj.", rtol=1e-4, atol=1e-5)
    checked("proj's output, loss and gradients")


def check_quick_start(g: dict[str, Any], asked: list[str]) -> None:
    import transformers

    assert asked == ["bert-large-uncased"], asked
    model = g["model"]
    assert isinstance(model, transformers.BertLMHeadModel)
    assert model.config.hidden_size == small_bert_config().hidden_size
    assert callable(g["apply_and_build_schedule"]) and callable(g["train"])
    checked("BertLMHeadModel built from the (substituted) bert-large-uncased config")


def run_script(name: str) -> None:
    script = REFERENCE / name
    asked = _offline_auto_config() if name == "quick-start.py" else []
    _install_recorders()
    sys.argv = [str(script)]
    g = runpy.run_path(str(script), run_name="__main__")
    checks: dict[str, Callable[[dict[str, Any]], None]] = {
        "debug-print.py": check_debug_print,
        "mlp-multi-gpu.py": check_mlp_multi_gpu,
        "attention-single-gpu.py": check_attention,
        "quick-start.py": lambda g: check_quick_start(g, asked),
    }
    checks[name](g)
    print("ALL CHECKS PASSED", flush=True)


# ---- the tests (in pytest) ----------------------------------------------------------------------
# name -> the number of CHECKED lines its run prints when every check ran.
SCRIPTS = {
    "quick-start.py": 1,
    "attention-single-gpu.py": 3,
    "mlp-multi-gpu.py": 2,
    "debug-print.py": 4,
}


def run_reference(name: str) -> subprocess.CompletedProcess:
    from dist_utils import free_port

    if not (REFERENCE / name).is_file():
        pytest.skip(f"the reference tutorial {REFERENCE / name} is not here")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # mlp-multi-gpu.py starts a one-process gloo group
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), name]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE, cwd=ROOT, env=env)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.distributed) if n == "mlp-multi-gpu.py" else n
        for n in SCRIPTS
    ],
)
def test_reference_tutorial_runs_unchanged_and_matches_the_unscheduled_model(name):
    if name == "quick-start.py":
        pytest.importorskip("transformers")
    done = run_reference(name)
    out = done.stdout
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{out[-3000:]}\n{done.stderr}"
    lines = [line for line in out.splitlines() if line.startswith("CHECKED ")]
    assert len(lines) == SCRIPTS[name], lines
    assert out.rstrip().endswith("ALL CHECKS PASSED"), out[-2000:]


if __name__ == "__main__":
    run_script(sys.argv[1])
