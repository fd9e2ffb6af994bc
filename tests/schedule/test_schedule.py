"""The schedule tree, path lookup, metadata and the primitive registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo
from hf_models import llama, make
from slapo.schedule import PRIMITIVES


def test_tree_mirrors_module_tree_including_module_lists():
    model = make("llama")
    sch = slapo.create_schedule(model)
    module_paths = [n for n, _ in model.named_modules(remove_duplicate=False)]
    schedule_paths = [p for p, _ in sch.named_schedules()]
    assert schedule_paths == module_paths
    layers = sch["model.layers"]
    assert layers.is_module_list and not sch["model"].is_module_list
    attn = sch["model.layers.0.self_attn"]
    assert attn.mod is model.model.layers[0].self_attn
    assert attn.path == "model.layers.0.self_attn" and attn.name == "self_attn"
    assert attn.parent is sch["model.layers.0"] and attn.root is sch
    assert sch["model.layers"][1] is sch["model.layers.1"]
    assert set(attn.child) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "model.layers.0.mlp" in sch and "model.layers.9" not in sch


def test_wrong_path_is_a_keyerror_naming_path_and_close_names():
    sch = slapo.create_schedule(make("llama"))
    with pytest.raises(slapo.SchedulePathError) as info:
        sch["model.layer.0.self_attn"]
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, slapo.SlapoError)
    msg = str(err)
    assert '"model.layer.0.self_attn"' in msg and '"layer" is not a child of "model"' in msg
    assert "model.layers.0.self_attn" in msg  # the closest existing name
    with pytest.raises(KeyError, match='Children of "model.layers.0"'):
        sch["model.layers.0.attn"]


def test_metadata_records_every_primitive_in_order_with_arguments():
    sch = slapo.create_schedule(make("llama"))
    sch["model.layers.1"].checkpoint()
    sch["model.layers.0.mlp.down_proj"].annotate("weight", "tag", 3)
    sch["model.layers.0"].checkpoint()
    recs = sch.metadata.primitives
    assert [(r.path, r.name) for r in recs] == [
        ("model.layers.1", "checkpoint"),
        ("model.layers.0.mlp.down_proj", "annotate"),
        ("model.layers.0", "checkpoint"),
    ]
    assert recs[1].args == ("weight", "tag", 3)
    assert sch["model.layers.0"].metadata is sch.metadata
    assert sch.metadata.param_tags == {"tag"}
    assert [str(r) for r in sch["model.layers.0"].applied_primitives] == ["checkpoint()"]


def test_print_shows_tree_and_applied_primitives():
    sch = slapo.create_schedule(make("llama"))
    sch["model.layers.0"].checkpoint()
    text = str(sch)
    assert text.startswith("Schedule(LlamaForCausalLM)")
    assert "0 (LlamaDecoderLayer)  [checkpoint()]" in text
    assert "1 (LlamaDecoderLayer)\n" in text  # the unscheduled layer has no suffix
    assert "self_attn (LlamaAttention)" in text


def test_registry_lists_primitives_with_docs_and_takes_user_primitives():
    names = slapo.list_primitives()
    for name in ("replace", "checkpoint", "fork_rng", "annotate", "sync", "hook"):
        assert name in names
    classes = slapo.list_primitives(name_only=False)
    assert all(cls.__doc__ and "Example" in cls.__doc__ for cls in classes.values())

    @slapo.register_primitive()
    class Scale(slapo.Primitive):
        """Scale the module's output."""

        name = "scale_output_test"

        @staticmethod
        def apply(sch, factor):
            sch.mod.register_forward_hook(lambda m, a, out: out * factor)

    try:
        sch = slapo.create_schedule(nn.Sequential(nn.Linear(3, 3)))
        x = torch.randn(2, 3)
        ref = sch.mod(x)
        sch["0"].scale_output_test(2.0)
        torch.testing.assert_close(sch.mod(x), ref * 2)
        assert sch.metadata.primitives[-1].name == "scale_output_test"
        with pytest.raises(slapo.SlapoError, match="already registered"):
            slapo.register_primitive()(
                type("Again", (slapo.Primitive,), {"name": "scale_output_test"})
            )
    finally:
        PRIMITIVES.pop("scale_output_test")
    with pytest.raises(AttributeError, match="list_primitives"):
        sch.no_such_primitive()


def test_nested_primitive_calls_record_only_the_outer_one():
    @slapo.register_primitive()
    class CheckpointAll(slapo.Primitive):
        """Checkpoint every child."""

        name = "checkpoint_children_test"

        @staticmethod
        def apply(sch):
            for child in sch.child.values():
                child.checkpoint()

    try:
        sch = slapo.create_schedule(llama())
        sch["model.layers"].checkpoint_children_test()
        assert [r.name for r in sch.metadata.primitives] == ["checkpoint_children_test"]
    finally:
        PRIMITIVES.pop("checkpoint_children_test")


def test_create_schedule_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        slapo.create_schedule("not a module")


def test_checkpoint_functions_load_on_first_use():
    import slapo.checkpoints as io
    from slapo import load_checkpoint

    assert slapo.save_checkpoint is io.save_checkpoint and load_checkpoint is io.load_checkpoint
    with pytest.raises(AttributeError, match="no_such_name"):
        slapo.no_such_name  # noqa: B018
