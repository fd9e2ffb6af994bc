"""Worker functions run in spawned gloo processes; each groups many checks into one job."""

from __future__ import annotations

import copy

import plans
import torch
import torch.distributed as dist
import transformers
from torch import nn

import hf_models
import slapo
from dist_utils import run_checks
from slapo.sharding import count_collectives, get_shard_spec

TOL = {"rtol": 1e-4, "atol": 1e-5}


def local_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    spec = get_shard_spec(param)
    return full if spec is None else spec.local_slice(full)


def assert_grads_are_slices(model: nn.Module, ref_grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        assert param.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(
            param.grad, local_of(param, ref_grads[name]), **TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def tp_model(family: str, world: int, **plan_kw):
    ref = hf_models.make(family, dropout=0.0)
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    plans.PLANS[family](sch, world, **plan_kw)
    built, _ = slapo.build(sch, init_weights=False)
    return ref, built, sch


def check_family(family: str, world: int) -> None:
    ref, model, _ = tp_model(family, world)
    data = hf_models.batch()
    ref_loss, ref_grads = hf_models.run(ref, data)
    with count_collectives() as counts:
        loss, _ = hf_models.run(model, data)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert_grads_are_slices(model, ref_grads)
    blocks = 2  # hf_models configs have two blocks
    extra_fwd = 1 if family == "gpt2" else 0  # the vocab-parallel embedding
    extra_bwd = 1 if family == "gpt2" else 0  # the input gradient of the vocab-parallel head
    assert counts[("fwd", "all_reduce")] == 2 * blocks + extra_fwd, counts
    assert counts[("bwd", "all_reduce")] == 2 * blocks + extra_bwd, counts


def check_gpt2_padded_vocab_cross_entropy(world: int) -> None:
    from slapo.sharding import vocab_parallel_cross_entropy

    cfg = transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).train()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    plans.gpt2(sch, world, pad=True, gather_logits=False)
    wte = model.transformer.wte
    assert model.lm_head.weight is wte.weight, "tied weights must stay tied"
    assert (
        wte.num_embeddings == 49 * 2 // world and model.lm_head.out_features == wte.num_embeddings
    )
    assert get_shard_spec(wte.weight).full_shape == (97, 32)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    logits = model(input_ids=ids).logits
    loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], vocab_size=97)
    loss.backward()
    torch.testing.assert_close(loss, ref_out.loss, **TOL)
    assert_grads_are_slices(model, {n: p.grad for n, p in ref.named_parameters()})


def check_sequence_parallel(world: int) -> None:
    from slapo.sharding import allreduce_sequence_parallel_grads

    ref, model, _ = tp_model("gpt2", world, vocab_parallel=False, sequence_parallel=True)
    data = hf_models.batch()
    ref_loss, ref_grads = hf_models.run(ref, data)
    with count_collectives() as counts:
        loss, _ = hf_models.run(model, data)
        assert allreduce_sequence_parallel_grads(model) == 2 * 6 + 2  # ln_1, ln_2, 2 biases; ln_f
    assert counts[("fwd", "all_gather")] == 2 * 2 + 1 and counts[("fwd", "reduce_scatter")] == 4
    torch.testing.assert_close(loss, ref_loss, **TOL)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, local_of(dict(model.named_parameters())[name], ref_grads[name]), **TOL
        )


def check_fork_rng_dropout(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    sch = slapo.create_schedule(model)
    sch["0"].shard("weight", axis=0)
    sch["0"].shard("bias", axis=0)
    sch["2"].shard("weight", axis=1)
    sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["1"].fork_rng()
    masks = []
    model[1].register_forward_hook(lambda m, a, out: masks.append((out != 0).float()))
    x = torch.ones(4, 8)
    for _ in range(2):
        slapo.set_random_seed(7, tp_rank=rank)
        model(x)
    # Exact: a dropout mask is a function of the generator state alone.
    assert torch.equal(masks[0], masks[1]), "the same seed must give the same mask"
    gathered = [torch.empty_like(masks[0]) for _ in range(world)]
    dist.all_gather(gathered, masks[0])
    assert not torch.equal(gathered[0], gathered[1]), "TP ranks must draw different masks"


def expect_error(fn, *needles: str) -> None:
    try:
        fn()
    except slapo.SlapoError as err:
        for needle in needles:
            assert needle in str(err), f"{needle!r} not in: {err}"
        return
    raise AssertionError(f"no error raised; expected one mentioning {needles}")


def check_bad_input(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.Embedding(97, 8), nn.Linear(4, 4))
    sch = slapo.create_schedule(model)
    expect_error(lambda: sch["0"].shard("wieght", axis=0), '"0"', "wieght", "weight")
    expect_error(lambda: sch["0"].shard("weight", axis=2), '"0"', "axis 2")
    expect_error(lambda: sch["0"].shard("weight", axis=1), '"0"', "size 5", "group size 2")
    expect_error(lambda: sch["1"].shard("weight", axis=0), '"1"', "size 97", "pad=True")
    expect_error(lambda: sch["0"].sync(mode="fwd_later"), '"0"', "fwd_later")
    expect_error(lambda: sch["0"].sync(mode="fwd_post", sync_op_or_fn="all_sum"), '"0"', "all_sum")
    sub = dist.new_group([0])
    sch["2"].group = sub
    if rank == 0:
        sch["2"].shard("weight", axis=0)  # a group of one: rank 0 keeps everything
        sch["2"].group = None
        expect_error(lambda: sch["2"].sync(mode="fwd_post"), '"2"', "does not match")
    else:
        expect_error(lambda: sch["2"].shard("weight", axis=0), '"2"', "not a member")


def check_consolidate(world: int) -> None:
    def init_fn(mod: nn.Module) -> None:
        for p in mod.parameters(recurse=False):
            p.normal_(0.0, 0.02)

    for fn in (init_fn, None):
        with slapo.init_empty_weights():
            meta = hf_models.gpt2(dropout=0.0)
            ref = hf_models.gpt2(dropout=0.0)
        sch = slapo.create_schedule(meta)
        plans.gpt2(sch, world)
        torch.manual_seed(11)
        _consolidate(sch, fn)
        torch.manual_seed(11)
        slapo.initialization.materialize_module(ref, init_fn=fn)
        full = dict(ref.named_parameters())
        for name, p in meta.named_parameters():
            assert not p.is_meta, name
            # Exact: the shard is a slice of the same full-size draw (a copy).
            torch.testing.assert_close(p, local_of(p, full[name]), rtol=0, atol=0)
        assert meta.lm_head.weight is meta.transformer.wte.weight


def _consolidate(sch, fn):
    from slapo.consolidate import consolidate_model

    return consolidate_model(sch, param_init_fn=fn)


def tp2_job(rank: int, world: int, ckpt_dir: str) -> dict:
    """Everything at TP=2: equivalence, counts, dropout, errors, consolidation, checkpoints."""
    return run_checks(
        {
            "gpt2": lambda: check_family("gpt2", world),
            "llama": lambda: check_family("llama", world),
            "bert": lambda: check_family("bert", world),
            "gpt2_padded_vocab_ce": lambda: check_gpt2_padded_vocab_cross_entropy(world),
            "sequence_parallel": lambda: check_sequence_parallel(world),
            "fork_rng": lambda: check_fork_rng_dropout(rank, world),
            "bad_input": lambda: check_bad_input(rank, world),
            "consolidate": lambda: check_consolidate(world),
            "save": lambda: save_trained(world, ckpt_dir),
        }
    )


def train_step(model: nn.Module) -> torch.optim.Optimizer:
    # SGD: Adam would amplify rounding noise in near-zero gradients into lr-sized steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hf_models.run(model, hf_models.batch())
    opt.step()
    return opt


def save_trained(world: int, ckpt_dir: str) -> None:
    from slapo.checkpoints import export_safetensors, save_checkpoint

    _, model, _ = tp_model("gpt2", world)
    opt = train_step(model)
    save_checkpoint(model, f"{ckpt_dir}/ckpt", opt)
    export_safetensors(model, f"{ckpt_dir}/hf")


def tp4_job(rank: int, world: int, ckpt_dir: str) -> dict:
    return run_checks(
        {
            "gpt2": lambda: check_family("gpt2", world),
            "bert": lambda: check_family("bert", world),
            "load_tp2_into_tp4": lambda: check_load(world, ckpt_dir),
            "mesh_2d": lambda: check_mesh(rank),
        }
    )


def check_load(world: int, ckpt_dir: str) -> None:
    from slapo.checkpoints import load_checkpoint

    ref = hf_models.make("gpt2", dropout=0.0)
    ref_opt = train_step(ref)
    _, model, _ = tp_model("gpt2", world)
    model.apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
    opt = torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)
    load_checkpoint(model, f"{ckpt_dir}/ckpt", opt)
    assert opt.param_groups[0]["lr"] == 0.1
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, local_of(p, ref_params[name]), **TOL)
        ref_state = ref_opt.state[ref_params[name]]
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], local_of(p, ref_state["momentum_buffer"]), **TOL
        )


def check_mesh(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expect_error(
        lambda: slapo.create_schedule(nn.Linear(4, 4), group=mesh).shard("weight", axis=0),
        "2-D DeviceMesh",
        "mesh['tp']",
    )
    ref = hf_models.make("llama", dropout=0.0)
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model, group=mesh["tp"])
    plans.llama(sch, 2)
    dp_rank = mesh.get_local_rank("dp")
    batches = [hf_models.batch(seed=s) for s in (0, 1)]
    loss, _ = hf_models.run(model, batches[dp_rank])
    for p in model.parameters():  # data-parallel average of the gradients
        dist.all_reduce(p.grad, group=mesh["dp"].get_group())
        p.grad /= 2
    ref.zero_grad()
    torch.manual_seed(1)
    ref_losses = [ref(**b).loss for b in batches]
    (sum(ref_losses) / 2).backward()
    torch.testing.assert_close(loss, ref_losses[dp_rank].detach(), **TOL)
    assert_grads_are_slices(model, {n: p.grad for n, p in ref.named_parameters()})


def die_job(rank: int, world: int, ckpt_dir: str, how: str) -> str:
    """Rank 1 fails (raises, or exits mid-save); rank 0 must get a clear error, not hang."""
    import os
    import time

    from slapo.checkpoints import save_checkpoint
    from slapo.sharding import all_reduce

    model = nn.Linear(4, 4)
    if how == "raise":
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        start = time.monotonic()
        try:
            all_reduce(torch.ones(2))
        except slapo.SlapoError as err:
            return f"{time.monotonic() - start:.1f}s {err}"
        return "no error"
    save_checkpoint(model, f"{ckpt_dir}/ckpt")  # a complete checkpoint first
    if rank == 1:  # dies inside the safetensors writer, mid-save
        import safetensors.torch

        def killed(*args, **kwargs):
            os._exit(3)

        safetensors.torch.save_file = killed
    save_checkpoint(model, f"{ckpt_dir}/ckpt_new")
    return "no error"
