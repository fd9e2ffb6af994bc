"""Scheduling on the meta device (issue 26, item 5): a model created under
``slapo.init_empty_weights()`` is scheduled and traced before ``slapo.build`` materializes it, and
``slapo.Verify`` around such a schedule checks it on a materialized reference copy (the model's
own initialization; the scheduled model runs with the same values by parameter name, a shard
with its slice), leaving the user's model on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo
from dist_utils import check_all, run_workers
from slapo.initialization import materialize_module
from slapo.verify import MetaVerifyError, VerificationError


def meta_bert():
    from transformers import BertConfig, BertLMHeadModel

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        is_decoder=True,
        use_cache=False,
    )
    with slapo.init_empty_weights():
        model = BertLMHeadModel(config)
    return model


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def all_meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


class Doubled(nn.Linear):
    """A Linear with other math (same parameter names): a wrong replacement."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_verify_around_a_meta_schedule_checks_it_and_leaves_the_model_on_meta():
    model = meta_bert()
    sch = slapo.create_schedule(model)  # no example inputs: the blocks trace on fake inputs
    with slapo.Verify(sch, example_inputs=[IDS]):
        sch["bert.encoder.layer.0.attention.self"].trace()
        sch["bert.encoder.layer.0.intermediate"].trace()
        sch["bert.encoder.layer.1"].checkpoint()
        sch["bert.encoder.layer.1.intermediate.intermediate_act_fn"].replace(nn.GELU())
    assert all_meta(sch.mod)
    assert all(p.grad is None for p in sch.mod.parameters())


def test_a_meta_schedule_verifies_then_builds_and_trains():
    model = meta_bert()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_inputs=[IDS]):
        sch["bert.encoder.layer.0.intermediate"].trace()
        sch["bert.encoder.layer.1.output"].trace()
        sch["bert.encoder.layer.0"].checkpoint()
    assert all_meta(sch.mod)
    built, optimizer = slapo.build(
        sch,
        init_weights=model._init_weights,
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.5},
    )
    assert not any(p.is_meta for p in built.parameters())
    losses = []
    for _ in range(3):
        loss = built(IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_build_initializes_a_block_that_torch_export_traced_on_meta():
    model = meta_bert()
    sch = slapo.create_schedule(model, example_inputs=[IDS])
    sch["bert.encoder.layer.0.attention.self"].trace(tracer="export")
    built, _ = slapo.build(sch, init_weights=model._init_weights)
    assert torch.isfinite(built(IDS, labels=IDS).loss)


def test_a_wrong_replacement_on_meta_is_still_caught():
    model = meta_bert()
    sch = slapo.create_schedule(model)
    with slapo.init_empty_weights():
        doubled = Doubled(64, 32)  # same parameter names and shapes, other math
    with pytest.raises(VerificationError, match='"bert.encoder.layer.0.output.dense"'):
        with slapo.Verify(sch, example_inputs=[IDS]):
            sch["bert.encoder.layer.0.intermediate"].trace()
            sch["bert.encoder.layer.0.output.dense"].replace(doubled)
    assert all_meta(sch.mod)


def test_a_meta_parameter_with_no_counterpart_is_a_clear_error():
    model = meta_bert()
    sch = slapo.create_schedule(model)
    with slapo.init_empty_weights():
        wrapped = nn.Sequential(nn.Linear(64, 32))  # parameters "0.weight", "0.bias": new names
    with pytest.raises(MetaVerifyError) as info:
        with slapo.Verify(sch, example_inputs=[IDS]):
            sch["bert.encoder.layer.0.output.dense"].replace(wrapped)
    msg = str(info.value)
    assert '"bert.encoder.layer.0.output.dense.0" (Linear)' in msg, msg
    assert '"bert.encoder.layer.0.output.dense.0.weight"' in msg, msg
    assert "materialize the model before Verify" in msg and "same parameter names" in msg
    assert isinstance(info.value, slapo.SlapoError)
    assert all_meta(sch.mod)


def test_a_real_replacement_in_a_meta_schedule_is_checked_on_its_own_values():
    """A replacement with real weights keeps them; only meta tensors get the reference's."""
    model = meta_bert()
    sch = slapo.create_schedule(model)
    torch.manual_seed(1)
    with pytest.raises(VerificationError, match="bert.encoder.layer.1.output.dense"):
        with slapo.Verify(sch, example_inputs=[IDS]):
            sch["bert.encoder.layer.1.output.dense"].replace(nn.Linear(64, 32))
    assert sch["bert.encoder.layer.1.output.dense"].mod.weight.device.type == "cpu"


def _meta_tensor_parallel_job(rank: int, world: int) -> dict[str, str]:
    def meta_mlp():
        with slapo.init_empty_weights():
            return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def tensor_parallel(sch):
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["2"].shard("weight", axis=1)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = {}
    sch = slapo.create_schedule(meta_mlp())
    with slapo.Verify(sch, x, device="cpu"):
        tensor_parallel(sch)
        sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    weight = sch["0"].mod.weight
    report["sharded"] = f"{weight.device.type} {tuple(weight.shape)}"
    sch = slapo.create_schedule(meta_mlp())
    try:
        with slapo.Verify(sch, x, device="cpu"):
            tensor_parallel(sch)  # the fwd_post all_reduce on "2" is missing
    except VerificationError as err:
        report["missing_sync"] = str(err)
    return report


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_of_a_meta_tensor_parallel_schedule_on_two_gloo_ranks():
    reports = check_all(run_workers(_meta_tensor_parallel_job, world=2, timeout=60, deadline=180))
    for report in reports:
        assert report["sharded"] == "meta (8, 8)", report
        assert "output 0 differs" in report.get("missing_sync", ""), report


def _materialized_with_seed(sch_or_model, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if isinstance(sch_or_model, nn.Module):
        materialize_module(sch_or_model, init_fn=sch_or_model._init_weights)
        return sch_or_model
    built, _ = slapo.build(sch_or_model, init_weights=sch_or_model.mod._init_weights)
    return built


def test_an_exported_block_on_meta_builds_with_the_values_of_the_untraced_model():
    """Same init function, same seed: every parameter as materializing the untraced model."""
    model = meta_bert()
    sch = slapo.create_schedule(model, example_inputs=[IDS])
    sch["bert.encoder.layer.0"].trace(tracer="export")
    assert type(sch["bert.encoder.layer.0.attention.self.query"].mod) is not nn.Linear
    built = _materialized_with_seed(sch, seed=3)
    reference = _materialized_with_seed(meta_bert(), seed=3)
    want = dict(reference.named_parameters())
    got = dict(built.named_parameters())
    assert got.keys() == want.keys()
    for name, param in got.items():
        assert torch.equal(param, want[name]), name
    buffers = dict(reference.named_buffers())
    for name, buf in built.named_buffers():
        assert torch.equal(buf, buffers[name]), name
    built.eval(), reference.eval()  # no dropout: the same values give the same outputs
    torch.testing.assert_close(built(IDS).logits, reference(IDS).logits)


def test_a_block_traced_on_meta_without_inputs_traces_again_after_build():
    """Materializing gives the traced parameters storage: no edit, so other sizes trace again."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with slapo.init_empty_weights():
        model = BertModel(config)
    sch = slapo.create_schedule(model)
    sch["encoder.layer.0"].trace()  # no inputs on meta: invented sizes
    built, _ = slapo.build(sch, init_weights=model._init_weights)
    assert not any(p.is_meta for p in built.parameters())
    reference = BertModel(config)
    reference.load_state_dict(built.state_dict())
    gen = torch.Generator().manual_seed(2)
    for shape in [(3, 5), (2, 11)]:
        ids = torch.randint(0, 64, shape, generator=gen)
        out = built(ids).last_hidden_state
        want = reference(ids).last_hidden_state
        torch.testing.assert_close(out, want)
        out.square().sum().backward()
        want.square().sum().backward()
        grads = dict(reference.named_parameters())
        for name, param in built.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, msg=name)
        built.zero_grad()
        reference.zero_grad()
