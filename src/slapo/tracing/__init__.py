"""Graph capture of one module subtree: torch.export first, torch.fx with leaves second.

Slapo traces by need: only the module a static-graph primitive works on becomes a
``torch.fx.GraphModule``. With ``flatten=False`` the hierarchy is kept: every submodule that was
traced through becomes a ``GraphModule`` of its own under the same name, so the schedule tree (and
paths such as ``"mlp.down_proj"``) stays the same. Parameters and buffers stay the very same
objects, so optimizers, tied weights and checkpoints are unaffected.

Mode-dependent operations are made mode-aware after capture: dropout (functional or not) and the
dropout probability of scaled-dot-product attention follow ``module.train()``/``eval()`` as in
the untraced module, although tracing always runs in training mode.

A traced module stays true to the module it replaces. It keeps every parameter and buffer (also
those the captured call did not use: a missing submodule is the original one, put back) and the
plain attributes callers read (``attention_type``, ``layer_idx``). An exported graph is only
valid for calls like the captured one (export fixes a dimension a loop ran over, non-tensor
arguments, which optional arguments were given): its first call checks each call, and a call
unlike the traced one traces the original module again for it (graphs kept per signature, the
same parameters), or, once the graph was edited by a primitive, raises
:class:`TraceSignatureError` naming the module and the argument. A submodule that
assigns attributes during its call (state kept on the module) or calls a custom
``autograd.Function`` (a graph keeps no custom backward) stays a call of the original module; the
traced module itself doing so is refused with :class:`TraceEquivalenceError`.

Hooks survive: a traced child keeps the hooks of the module it replaces, and where a trace goes
through a hooked module (flattening, a decomposed layer inlined), ``sync``'s hooks record their
op as a call in the graph; a module with other hooks stays a call.

One file per job: ``capture`` (example inputs of a submodule), ``export`` (the torch.export
path), ``guard`` (the check of each call of an exported graph), ``retrace`` (tracing again for
another signature), ``effects`` (what a graph cannot
replay), ``keep`` (state and attributes kept), ``fx`` (the symbolic-trace path), ``rewrite``
(mode-aware dropout), ``inline`` (flattening), ``hooks`` (hooks across inlining), ``names`` (dynamo's names of module
calls, for ``tracer="dynamo"``), ``leaves`` and
``errors`` (shared by both paths), ``api`` (the entry points). The
``trace`` primitive, which binds a schedule, lives in ``slapo.primitives.trace``.

Example:
    >>> from torch import nn
    >>> from slapo.tracing import trace_module
    >>> gm = trace_module(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)), tracer="fx")
    >>> type(gm).__name__
    'Sequential'
"""

from .api import trace, trace_module
from .capture import as_args, call_args, capture_inputs
from .errors import LeafError, TraceEquivalenceError, TraceError, TraceSignatureError
from .export import export_module, is_cache
from .fx import fx_trace
from .inline import inline_submodules
from .leaves import Leaves, check_leaves, is_leaf
from .names import dynamo_name, mark_dynamo_names
from .rewrite import ModeDropout, TrainingOnly, make_mode_aware

__all__ = [
    "LeafError",
    "Leaves",
    "ModeDropout",
    "TraceEquivalenceError",
    "TraceError",
    "TraceSignatureError",
    "TrainingOnly",
    "as_args",
    "call_args",
    "capture_inputs",
    "check_leaves",
    "dynamo_name",
    "export_module",
    "fx_trace",
    "inline_submodules",
    "is_cache",
    "is_leaf",
    "make_mode_aware",
    "mark_dynamo_names",
    "trace",
    "trace_module",
]
