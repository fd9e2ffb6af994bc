"""Bad input to `slapo train`: one line on stderr naming the flag or file and the fix, exit
status 2, no traceback, nothing written to the output directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from your_inputs import LLAMA_POSITIONS, documents, write_jsonl

from slapo.cli import main


def _fails(argv: list[str], out: Path, capsys: pytest.CaptureFixture) -> str:
    """Run `slapo train argv`; assert the bad-input contract; return the stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv, "--steps", "2", "--no-progress", "--output-dir", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slapo train: "), err
    assert "Traceback" not in err and not out.exists()
    return lines[0]


def test_a_missing_data_file(tmp_path, capsys):
    line = _fails(["--data", str(tmp_path / "nope.jsonl")], tmp_path / "out", capsys)
    assert f"--data {tmp_path / 'nope.jsonl'}: no such file" in line


def test_an_empty_data_file(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    line = _fails(["--data", str(tmp_path / "empty.txt")], tmp_path / "out", capsys)
    assert "empty.txt is empty" in line


def test_a_data_file_with_no_text(tmp_path, capsys):
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    line = _fails(["--data", str(tmp_path / "blank.jsonl")], tmp_path / "out", capsys)
    assert "blank.jsonl holds no text" in line


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("latin1.txt", "caf\xe9 au lait".encode("latin-1"), "not UTF-8 text"),
        ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', "line 2 is not JSON"),
        ("list.jsonl", b"[1, 2]\n", "line 1 is a JSON list, not an object"),
    ],
)
def test_an_unreadable_data_file(tmp_path, capsys, name, content, says):
    (tmp_path / name).write_bytes(content)
    line = _fails(["--data", str(tmp_path / name)], tmp_path / "out", capsys)
    assert f"--data {tmp_path / name}" in line and says in line


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_a_data_file_without_read_permission(tmp_path, capsys):
    data = tmp_path / "secret.txt"
    data.write_text("text")
    data.chmod(0)
    line = _fails(["--data", str(data)], tmp_path / "out", capsys)
    assert "cannot read it" in line


def test_a_data_format_not_supported(tmp_path, capsys):
    (tmp_path / "table.csv").write_text("a,b\n")
    line = _fails(["--data", str(tmp_path / "table.csv")], tmp_path / "out", capsys)
    assert "unknown format '.csv'" in line


def test_a_data_field_no_record_has(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", documents(5), field="content")
    line = _fails(["--data", str(data), "--data-field", "body"], tmp_path / "out", capsys)
    assert "no record has the field 'body'" in line and "--data-field content" in line


def test_parquet_without_pyarrow_says_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1 not really")
    line = _fails(["--data", str(tmp_path / "t.parquet")], tmp_path / "out", capsys)
    assert "needs pyarrow" in line and "pip install pyarrow" in line


def test_a_tokenizer_larger_than_the_embeddings(tmp_path, capsys, llama_dir):
    # the built-in llama has 256 embeddings (one per byte); this tokenizer has 300 tokens
    data = write_jsonl(tmp_path / "d.jsonl", documents())
    line = _fails(["--tokenizer", str(llama_dir), "--data", str(data)], tmp_path / "out", capsys)
    assert f"--tokenizer {llama_dir}" in line and "300 tokens, more than the 256" in line


def test_a_seq_len_beyond_the_positions(tmp_path, capsys, llama_dir):
    argv = ["--model", str(llama_dir), "--seq-len", str(2 * LLAMA_POSITIONS)]
    line = _fails(argv, tmp_path / "out", capsys)
    assert f"--seq-len {2 * LLAMA_POSITIONS} is beyond the {LLAMA_POSITIONS} positions" in line


def test_a_model_directory_without_a_config(tmp_path, capsys):
    (tmp_path / "weights-only").mkdir()
    line = _fails(["--model", str(tmp_path / "weights-only")], tmp_path / "out", capsys)
    assert "has no config.json" in line and "save_pretrained" in line


def test_a_model_that_names_nothing(tmp_path, capsys):
    line = _fails(["--model", "no-such-model-type"], tmp_path / "out", capsys)
    assert "--model must be one of the families" in line and "'no-such-model-type'" in line


def test_a_knob_the_generic_plan_lacks_fails_before_any_training(tmp_path, capsys):
    line = _fails(["--model", "phi3", "--fuse-ops"], tmp_path / "out", capsys)
    assert line.startswith("slapo train: --fuse-ops: the generic plan")


@pytest.mark.slow
def test_the_command_exits_2_with_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "slapo", "train", "--model", str(tmp_path / "absent"),
           "--output-dir", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines() == [
        f"slapo train: --model {tmp_path / 'absent'}: no such directory; give a directory that "
        "save_pretrained wrote (config.json + model.safetensors)"
    ]
