"""Checkpoints in safetensors + JSON: round trip, from_pretrained, no pickle ever read, typed
errors, and recovery from a crash inside the atomic directory swap."""

from __future__ import annotations

import json
import logging
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

import hf_models
import slapo
from slapo.checkpoints import CheckpointError, load_checkpoint, load_tree, save_checkpoint


class _Payload:
    """A pickle that creates ``target`` when unpickled: what a crafted checkpoint would carry."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (exec, (f"open({str(self.target)!r}, 'w').close()",))


def _plant(path: Path, sentinel: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(sentinel)))


def _trained(family: str = "gpt2", seed: int = 0):
    model = hf_models.make(family, seed=seed, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hf_models.run(model, hf_models.batch())
    opt.step()
    return model, opt


def _fresh(family: str = "gpt2"):
    model = hf_models.make(family, seed=7, dropout=0.0)
    return model, torch.optim.AdamW(model.parameters(), lr=5.0)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler = _Warnings()
    logger = slapo.get_logger()  # propagate=False: attach to it directly
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_round_trip_restores_model_and_optimizer_exactly(tmp_path):
    model, opt = _trained()
    save_checkpoint(model, tmp_path / "ckpt", opt)
    assert {p.suffix for p in (tmp_path / "ckpt").iterdir()} == {".json", ".safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp-slapo left
    loaded, loaded_opt = _fresh()
    load_checkpoint(loaded, tmp_path / "ckpt", loaded_opt)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # the tie survives
    assert loaded_opt.param_groups[0]["lr"] == 1e-2
    # a copy, no arithmetic: bit-identical
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(loaded_opt.state[q][key], value), (name, key)
    for m, o in ((model, opt), (loaded, loaded_opt)):  # training goes on the same way
        hf_models.run(m, hf_models.batch(seed=1))
        o.step()
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checkpoint_loads_with_from_pretrained(tmp_path, family):
    model, opt = _trained(family)
    save_checkpoint(model, tmp_path / "ckpt", opt)
    cls = type(model)
    hf = cls.from_pretrained(tmp_path / "ckpt")
    own = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        assert torch.equal(p, own[name]), name


def test_a_crafted_pickle_is_never_unpickled(tmp_path):
    sentinel = tmp_path / "pwned"
    # the payload is live: unpickling it does create the file
    pickle.loads(pickle.dumps(_Payload(tmp_path / "live")))
    assert (tmp_path / "live").exists()

    model, opt = _trained()
    good = tmp_path / "good"
    save_checkpoint(model, good, opt)
    for name in (".metadata", "__0_0.distcp", "pytorch_model.bin", "optimizer.pt", "state.pt"):
        _plant(good / name, sentinel)
    loaded, loaded_opt = _fresh()
    load_checkpoint(loaded, good, loaded_opt)  # loads by JSON + safetensors alone
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)

    old = tmp_path / "old-dcp"  # the earlier torch.distributed.checkpoint format
    old.mkdir()
    _plant(old / ".metadata", sentinel)
    _plant(old / "__0_0.distcp", sentinel)
    marker = {"format": "slapo-dcp-v1", "model_keys": sorted(model.state_dict())}
    (old / "slapo_checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"slapo-dcp-v1.*pickle.*save it again"):
        load_checkpoint(loaded, old)

    bare = tmp_path / "no-marker"
    bare.mkdir()
    _plant(bare / ".metadata", sentinel)
    with pytest.raises(CheckpointError, match=r"not a complete Slapo checkpoint.*pickle"):
        load_checkpoint(loaded, bare)
    assert not sentinel.exists()


def test_resume_never_unpickles_an_old_torch_save_file(tmp_path):
    from slapo.train import TrainConfig, train

    sentinel = tmp_path / "pwned"
    _plant(tmp_path / "ckpt.pt", sentinel)
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=16, progress=False)
    with pytest.raises(CheckpointError, match=r"--resume .*is a file.*torch.save"):
        train(replace(cfg, resume=str(tmp_path / "ckpt.pt")))
    assert not sentinel.exists()


def test_other_shapes_are_a_checkpoint_error_naming_keys_and_shapes(tmp_path):
    model, _ = _trained()
    save_checkpoint(model, tmp_path / "ckpt")
    torch.manual_seed(0)
    wide = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=hf_models.VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4
        )
    )
    before = wide.transformer.wte.weight.clone()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(wide, tmp_path / "ckpt")
    message = str(info.value)
    assert "'transformer.wte.weight' in model.safetensors is [96, 32], the model's [96, 64]" in (
        message
    )
    assert str(tmp_path / "ckpt") in message
    assert torch.equal(wide.transformer.wte.weight, before)  # nothing was copied


def test_a_damaged_checkpoint_is_a_checkpoint_error_naming_the_file(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ckpt"
    save_checkpoint(model, path, opt)
    marker = path / "slapo_checkpoint.json"
    text = marker.read_text()
    marker.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=rf"{marker}.* not valid JSON"):
        load_checkpoint(model, path)
    marker.write_text(text)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=rf"{weights} is not a readable safetensors file"):
        load_checkpoint(model, path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors is missing"):
        load_checkpoint(model, path)
    with pytest.raises(CheckpointError, match=r"no such checkpoint"):
        load_checkpoint(model, tmp_path / "nowhere")


def _save_crashing_between_renames(model, path, monkeypatch) -> None:
    """Save, with the rename that follows ``path -> path.old-slapo`` failing like a crash."""
    real = os.rename
    previous = []

    def rename(src, dst):
        if previous and str(previous[-1]).endswith(".old-slapo"):
            raise OSError("simulated crash between the two renames")
        previous.append(dst)
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="simulated crash"):
        save_checkpoint(model, path)
    monkeypatch.setattr(os, "rename", real)


def test_a_crash_between_the_two_renames_loads_the_newest_complete_copy(
    tmp_path, monkeypatch, warnings_logged
):
    first, _ = _trained(seed=0)
    second, _ = _trained(seed=1)
    path = tmp_path / "ckpt"
    save_checkpoint(first, path)
    _save_crashing_between_renames(second, path, monkeypatch)
    tmp, old = tmp_path / "ckpt.tmp-slapo", tmp_path / "ckpt.old-slapo"
    assert not path.exists() and tmp.is_dir() and old.is_dir()

    loaded, _ = _fresh()
    load_checkpoint(loaded, path)
    assert torch.equal(loaded.transformer.wte.weight, second.transformer.wte.weight)
    assert any(str(tmp) in m and "interrupted" in m for m in warnings_logged), warnings_logged

    (tmp / "slapo_checkpoint.json").unlink()  # were the newer copy incomplete: the previous one
    load_checkpoint(loaded, path)
    assert torch.equal(loaded.transformer.wte.weight, first.transformer.wte.weight)
    assert any(str(old) in m for m in warnings_logged), warnings_logged

    save_checkpoint(second, path)  # the next save finishes cleanly
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    load_checkpoint(loaded, path)
    assert torch.equal(loaded.transformer.wte.weight, second.transformer.wte.weight)


def test_a_save_after_the_crash_first_finishes_the_swap(tmp_path, monkeypatch, warnings_logged):
    import safetensors.torch

    first, _ = _trained(seed=0)
    second, _ = _trained(seed=1)
    path = tmp_path / "ckpt"
    save_checkpoint(first, path)
    _save_crashing_between_renames(second, path, monkeypatch)

    def disk_full(*args, **kwargs):
        raise OSError("no space left on device")

    # the next save dies while writing: `second`, the newest complete copy, must survive it
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(CheckpointError, match="no space left"):
        save_checkpoint(first, path)
    assert any(f"restored it from {path}.tmp-slapo" in m for m in warnings_logged)
    loaded, _ = _fresh()
    load_checkpoint(loaded, path)
    assert torch.equal(loaded.transformer.wte.weight, second.transformer.wte.weight)


def test_save_tree_round_trips_nested_state_without_pickle(tmp_path):
    model, opt = _trained()
    tree = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "record": {"losses": [1.5, float("inf")], "seconds": 0.25},
    }
    slapo.checkpoints.save_tree(tmp_path / "state", tree, config=model.config)
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == [
        "config.json",
        "model.safetensors",
        "slapo_checkpoint.json",
        "state.safetensors",
    ]
    back = load_tree(tmp_path / "state")
    assert back["record"] == tree["record"] and back["rng"].dtype == torch.uint8
    assert torch.equal(back["rng"], tree["rng"])
    assert set(back["optimizer"]["state"]) == set(tree["optimizer"]["state"])  # int keys
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again
    for key, value in tree["model"].items():
        assert torch.equal(back["model"][key], value), key
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "state")  # the model part
    assert torch.equal(hf.transformer.wte.weight, model.transformer.wte.weight)
    with pytest.raises(CheckpointError, match="slapo train --resume"):
        load_checkpoint(model, tmp_path / "state")
    with pytest.raises(CheckpointError, match="object is a Linear"):
        slapo.checkpoints.save_tree(tmp_path / "bad", {"object": torch.nn.Linear(2, 2)})
