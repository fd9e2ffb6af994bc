"""`slapo train --data`: files read, documents joined with the end-of-text token, packed into
windows, and cached beside the data so that a second run tokenizes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from your_inputs import documents, write_jsonl

from slapo.data import TokenBatches
from slapo.train import TrainConfig, prepare_inputs, train
from slapo.train import token_cache as token_cache_module
from slapo.train.token_cache import load_tokens
from slapo.train.tokenizer import BYTE_EOS, ByteTokenizer

RUN = {"steps": 2, "batch_size": 2, "seq_len": 32, "progress": False, "sample": False,
       "baseline_steps": 0, "compile_model": False}  # fmt: skip


def test_the_token_cache_is_reused_on_the_second_run(tmp_path, llama_dir, monkeypatch):
    data = write_jsonl(tmp_path / "train.jsonl", documents())
    cfg = {"model": str(llama_dir), "data": str(data), **RUN}
    first = train(TrainConfig(**cfg))
    cache = Path(first["token_cache"])
    assert first["from_cache"] is False and cache.is_file()
    stamp = cache.stat().st_mtime_ns
    calls = []
    real = token_cache_module._write  # tokenizes the files into the cache
    monkeypatch.setattr(token_cache_module, "_write", lambda *a: calls.append(a) or real(*a))
    second = train(TrainConfig(**cfg))
    assert second["from_cache"] is True and calls == []  # tokenized nothing
    assert second["token_cache"] == str(cache) and cache.stat().st_mtime_ns == stamp
    assert second["losses"] == first["losses"]  # the same tokens, the same batches
    # a changed file is a new cache (and tokenized anew)
    write_jsonl(data, documents(seed=1))
    third = prepare_inputs(TrainConfig(**cfg))
    assert third.data.path != cache and third.data.cached is False and calls


def test_documents_are_joined_with_eos_and_packed_from_a_directory(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first line\nsecond line\n")
    write_jsonl(root / "sub" / "b.jsonl", ["one", "two"], field="body")
    (root / "notes.md").write_text("not data")  # other suffixes are skipped
    (root / ".hidden").mkdir()
    (root / ".hidden" / "c.txt").write_text("skipped too")
    data = load_tokens(str(root), "body", ByteTokenizer())
    # a.txt has no "body" field to read: a .txt file is one document whatever the field
    expected = [*b"first line\nsecond line\n", BYTE_EOS, *b"one", BYTE_EOS, *b"two", BYTE_EOS]
    assert data.tokens.tolist() == expected and data.tokens.dtype == torch.uint16
    assert data.path.parent == tmp_path / ".slapo-cache" and data.path.name.startswith("corpus.")
    windows = TokenBatches(data.tokens, batch_size=3, seq_len=5, seed=0).next()["input_ids"]
    starts = {tuple(expected[i : i + 5]) for i in range(0, len(expected) - 4, 5)}
    assert all(tuple(row) in starts for row in windows.tolist())  # whole packed windows


def test_the_cache_is_keyed_by_the_tokenizer(tmp_path, llama_dir):
    from slapo.train.tokenizer import load_tokenizer

    data = tmp_path / "notes.txt"
    data.write_text("\n".join(documents(50)))
    by_bytes = load_tokens(str(data), "text", ByteTokenizer())
    by_bpe = load_tokens(str(data), "text", load_tokenizer(None, llama_dir))
    assert by_bytes.path != by_bpe.path and len(by_bpe.tokens) < len(by_bytes.tokens)
    assert load_tokens(str(data), "text", ByteTokenizer()).cached


def test_no_data_flag_keeps_the_embedded_corpus_as_bytes():
    inputs = prepare_inputs(TrainConfig())
    assert inputs.tokens is None and inputs.tokenizer.name == "bytes"
    assert bytes(inputs.prompt) == b"def " and inputs.describe()["data"] == "embedded corpus"


def test_parquet_data_is_read_by_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["ab", None, "cd"]}), tmp_path / "t.parquet")
    data = load_tokens(str(tmp_path / "t.parquet"), "body", ByteTokenizer())
    assert data.tokens.tolist() == [*b"ab", BYTE_EOS, *b"cd", BYTE_EOS]


def test_metrics_name_the_data(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("\n".join(documents(50)))
    out = tmp_path / "run"
    train(TrainConfig(model="gpt2", data=str(data), output_dir=str(out), **RUN))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"] == str(data) and metrics["tokenizer"] == "bytes"
    assert metrics["plan"] == "ready schedule of gpt2"
