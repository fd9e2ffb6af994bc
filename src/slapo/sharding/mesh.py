"""One ``DeviceMesh`` for five kinds of parallelism: pipeline, data, context, tensor and expert.

:func:`init_parallel_mesh` lays the ranks out in torchtitan's order, ``("pp", "dp", "cp",
"tp")``: tensor-parallel ranks adjacent (the busiest links innermost), pipeline stages
outermost. Expert parallelism borrows its ranks from dp x cp, as torchtitan does: dp splits
into (dp / (ep / cp), ep / cp), and an ep group is (ep / cp) x cp, whole cp groups; the ranks
that hold the same experts (``expert_replicas``) differ only in the first part of dp.

:meth:`ParallelMesh.apply` prepares a model for the mesh's cp and ep (before ``slapo.build``);
the data-parallel engine then averages gradients over ``grad`` (dp x cp).

Example (under ``torchrun --nproc-per-node 8``, after ``slapo.env.setup()``)::

    mesh = init_parallel_mesh("cpu", dp=2, cp=2, tp=2)
    sch = slapo.model_schedule.apply_schedule(model, group=mesh.tp, attn_op=None)
    context = mesh.apply(sch.mod)          # attention over mesh.cp; experts over mesh.ep
    model, opt = slapo.build(sch, target="ddp", group=mesh.grad, optimizer=torch.optim.AdamW)
    loss = slapo.train_step(model, context.model_batch(batch))  # the dp replica's full batch
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..exceptions import SlapoError
from .context_parallel import ContextParallel, context_parallel
from .expert_grads import reduce_expert_grads
from .expert_parallel import expert_parallel

__all__ = ["MESH_DIMS", "ParallelMesh", "check_sizes", "init_parallel_mesh"]

#: The mesh's dimensions, outermost first (torchtitan's order).
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and the 1-D meshes each kind of parallelism runs on.

    ``mesh``: the ``("pp", "dp", "cp", "tp")`` DeviceMesh; ``grad``: dp x cp (flattened), the
    ranks whose gradients a data-parallel engine averages; ``ep``: the ranks splitting each MoE
    layer's experts (None without ep); ``expert_replicas``: the ranks holding the same experts.
    """

    mesh: DeviceMesh
    grad: DeviceMesh
    ep: DeviceMesh | None = None
    expert_replicas: DeviceMesh | None = None

    def size(self, dim: str) -> int:
        """The size of ``dim`` (one of :data:`MESH_DIMS`, or ``"ep"``)."""
        if dim == "ep":
            return 1 if self.ep is None else self.ep.size()
        return self.mesh[dim].size()

    def __getattr__(self, dim: str) -> DeviceMesh:
        # mesh.pp, mesh.dp, mesh.cp, mesh.tp: the 1-D meshes
        if dim in MESH_DIMS:
            return self.mesh[dim]
        raise AttributeError(dim)

    def apply(self, model: nn.Module) -> ContextParallel | None:
        """Prepare ``model`` (in place, before ``slapo.build``) for the mesh's cp and ep: its
        attention runs over ``cp`` (returns what shards each batch; None with cp 1); its MoE
        experts split over ``ep``, their gradients reduced over ``expert_replicas`` and averaged
        over dp x cp by hooks (the data-parallel engines leave them to those).

        Example:
            >>> import torch
            >>> model = torch.nn.Linear(4, 4)  # the model the mesh's plan was written for
            >>> # on the ranks of a parallel job (torchrun): not run here
            >>> mesh = init_parallel_mesh("cpu", tp=2)  # doctest: +SKIP
            >>> context = mesh.apply(model)  # doctest: +SKIP
        """
        context = None
        if self.size("cp") > 1:
            context = context_parallel(model, self.cp)
        if self.ep is not None:
            expert_parallel(model, self.ep)
            reduce_expert_grads(model, self.expert_replicas, average_over=self.grad.size())
        return context


def check_sizes(world: int, pp: int, cp: int, tp: int, ep: int) -> int:
    """The data-parallel size of ``world`` ranks, or a :class:`SlapoError` naming the sizes
    that do not fit.

    Example:
        >>> check_sizes(8, pp=1, cp=2, tp=2, ep=2)
        2
    """
    model_parallel = pp * cp * tp
    if world % model_parallel:
        sizes = (("tp", tp), ("pp", pp), ("cp", cp))
        flags = " x ".join(f"--{k} {v}" for k, v in sizes if v > 1)
        raise SlapoError(
            f"{flags} needs a multiple of {model_parallel} processes, not {world}: "
            f"torchrun --nproc-per-node {model_parallel} (or a multiple, for data parallelism)"
        )
    dp = world // model_parallel
    if ep > 1 and (ep % cp or (dp * cp) % ep):
        raise SlapoError(
            f"--ep {ep} borrows its ranks from dp x cp = {dp} x {cp}: it must divide "
            f"{dp * cp} and be a multiple of --cp {cp}"
        )
    return dp


def init_parallel_mesh(
    device: str, *, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, dp: int | None = None
) -> ParallelMesh:
    """Lay every rank of the default process group out on one mesh (``dp``: the rest).

    Example:
        >>> mesh = init_parallel_mesh("cuda", cp=2, tp=2, ep=2)  # doctest: +SKIP
        >>> mesh.size("dp"), mesh.grad.size()  # doctest: +SKIP
        (2, 4)
    """
    world = dist.get_world_size()
    rest = check_sizes(world, pp, cp, tp, ep)
    if dp is not None and dp != rest:
        raise SlapoError(
            f"init_parallel_mesh: dp={dp} x pp={pp} x cp={cp} x tp={tp} is not the "
            f"{world} ranks of the process group (dp would be {rest})"
        )
    mesh = init_device_mesh(device, (pp, rest, cp, tp), mesh_dim_names=MESH_DIMS)
    grad = mesh[("dp", "cp")]._flatten("dp_cp") if cp > 1 else mesh["dp"]
    if ep == 1:
        return ParallelMesh(mesh, grad)
    # The same ranks with dp split in two: ep is (dp_in_ep, cp) flattened.
    inner = ep // cp
    names = ("pp", "dp_mod_ep", "dp_in_ep", "cp", "tp")
    split = DeviceMesh(
        device, mesh.mesh.reshape(pp, rest // inner, inner, cp, tp), mesh_dim_names=names
    )
    return ParallelMesh(mesh, grad, split[("dp_in_ep", "cp")]._flatten("ep"), split["dp_mod_ep"])
