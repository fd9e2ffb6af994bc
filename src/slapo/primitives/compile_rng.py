"""Where a compiled region's random numbers come from (``compile(rng=...)``), for inductor.

* ``"eager"``: torch's generator, op by op, as eager code draws them (inductor's
  ``fallback_random``): the compiled region gives the eager masks.
* ``"bulk"``: every dropout (``native_dropout``, to which ``nn.Dropout``, ``F.dropout`` and SDPA's
  attention dropout lower) draws its mask with :func:`slapo.op.dropout.bulk_dropout`, four
  decisions per 64-bit draw of torch's generator: about 4x cheaper masks on CPU, the masks eager
  code draws under :func:`slapo.op.dropout.bulk_dropout_masks`. A dropout that a selective
  checkpoint recomputes is drawn under a saved generator state and replayed in backward (forward
  and backward use one mask), but inductor may then order the draws otherwise than eager code:
  in T5 with ``recompute_dropout`` the masks differed from the eager reference's (gradients
  consistent with the loss, checked by finite differences in float64), which is why the ready
  schedules keep dropout in their policies under ``bulk``.
* ``"inductor"``: inductor's own generated random numbers (``fallback_random=False``).

The ``bulk`` lowering is a decomposition handed to inductor's ``compile_fx``. Inductor's caches
(FX graph, AOT autograd) do not key on decompositions, so a marker post-grad pass whose ``uuid``
names the dropout code enters the cache key: a graph compiled with bulk masks is never served to
a region compiled without them, nor the reverse. The pass also checks that no ``native_dropout``
survived the decomposition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..exceptions import SlapoError

__all__ = ["RNG_MODES", "CompileError", "inductor_backend"]

RNG_MODES = ("eager", "bulk", "inductor")


class CompileError(SlapoError, RuntimeError):
    """A module scheduled with ``compile`` could not be compiled (raised at its first call).

    It lives here, beside the backends that raise it; :mod:`slapo.primitives.compile` exports it."""


def inductor_backend(rng: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """``torch.compile``'s ``(backend, options)`` for inductor with random numbers from ``rng``.

    Example:
        >>> backend, options = inductor_backend("eager", {})
        >>> backend, options["fallback_random"]
        ('inductor', True)
    """
    if rng == "eager":
        return "inductor", {"fallback_random": True, **options}
    if rng == "inductor":
        return "inductor", {**options, "fallback_random": False}
    return _bulk_backend({**options, "fallback_random": True}), None


def _bulk_backend(options: dict[str, Any]) -> Callable[..., Any]:
    """A backend: inductor with ``native_dropout`` decomposed into :func:`bulk_dropout`."""

    def compile_bulk(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # deferred: inductor takes seconds to import; only a compiled call needs it
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        from ..op.dropout import bulk_dropout

        patches = {**options}
        patches["post_grad_custom_post_pass"] = _bulk_marker(
            options.get("post_grad_custom_post_pass", config.post_grad_custom_post_pass)
        )
        with config.patch(patches):
            table = {**select_decomp_table(), torch.ops.aten.native_dropout.default: bulk_dropout}
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    return compile_bulk


def _bulk_marker(inner: Any) -> Any:
    """The post-grad pass that keys inductor's caches on the bulk dropout (see the module doc),
    running ``inner`` (a pass already configured) first."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from ..op import dropout

    class BulkDropoutMarker(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            if inner is not None:
                inner(graph)
            dropout = torch.ops.aten.native_dropout.default
            left = [n for n in graph.nodes if n.target is dropout]
            if left:  # the decomposition table did not reach them: they would draw eager masks
                raise CompileError(
                    f"compile(rng='bulk'): {len(left)} dropout op(s) escaped the bulk "
                    "decomposition; use rng='eager'"
                )

        def uuid(self) -> Any:
            if inner is not None and not hasattr(inner, "uuid"):
                return None  # a plain function cannot be keyed: inductor then skips its caches
            own = get_hash_for_files((dropout.__file__, __file__))
            return ("slapo-bulk-dropout", own, inner.uuid() if inner is not None else None)

    return BulkDropoutMarker()
