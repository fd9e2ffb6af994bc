"""Database: JSON on disk, atomic commits, reloads, and loud corruption errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slapo.tune import Database, DatabaseCorruptError, database


def test_commit_then_reload_sees_every_record(tmp_path):
    path = tmp_path / "results.json"
    db = Database(path)
    for i in range(5):
        db.commit(f"cfg{i}", {"status": "ok", "result": {"throughput": i * 1.5}})
    again = Database(str(path))
    assert len(again) == 5 and list(again) == [f"cfg{i}" for i in range(5)]
    assert again["cfg3"]["result"]["throughput"] == 4.5
    assert "cfg9" not in again and again.get("cfg9") is None
    doc = json.loads(path.read_text())  # plain JSON a human can read
    assert doc["records"]["cfg0"]["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left


def test_two_handles_on_one_file_lose_nothing(tmp_path):
    path = tmp_path / "db.json"
    a, b = Database(path), Database(path)
    a.commit("x", 1)
    b.commit("y", 2)  # b loaded before x existed; its commit must keep x
    a.commit("z", 3)
    assert dict(Database(path).items()) == {"x": 1, "y": 2, "z": 3}
    b.load()
    assert set(b) == {"x", "y", "z"}


def test_in_memory_database_writes_nothing(tmp_path):
    db = Database()
    db.commit("k", {"v": 1})
    assert db["k"] == {"v": 1} and len(db) == 1


@pytest.mark.parametrize(
    "content",
    [
        '{"format": "slapo-tune-db", "version": 1, "records": {"a": ',
        "[1, 2]",
        '{"records": {}}',
        '{"format": "slapo-tune-db", "version": 99, "records": {}}',
    ],
)
def test_corrupt_file_is_a_clear_error_and_left_untouched(tmp_path, content):
    path = tmp_path / "db.json"
    path.write_text(content)
    with pytest.raises(DatabaseCorruptError, match="db.json"):
        Database(path)
    assert path.read_text() == content


def test_commit_refuses_to_overwrite_a_file_corrupted_after_load(tmp_path):
    path = tmp_path / "db.json"
    db = Database(path)
    db.commit("a", 1)
    path.write_text("garbage")
    with pytest.raises(DatabaseCorruptError):
        db.commit("b", 2)
    assert path.read_text() == "garbage"


def test_bad_arguments_are_typed_errors_and_write_nothing(tmp_path):
    path = tmp_path / "db.json"
    db = Database(path)
    db.commit("a", 1)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="key"):
        db.commit(3, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON"):
        db.commit("b", {"model": object()})
    with pytest.raises(TypeError, match="JSON"):
        db.commit("c", float("nan"))
    with pytest.raises(TypeError, match="db_file_name"):
        Database(42)  # type: ignore[arg-type]
    assert path.read_bytes() == before


# database.py needs only the stdlib and the errors (tune/errors.py, exceptions.py): bare package
# stubs let the child import it without running slapo's __init__ (and importing torch).
_WRITER = """
import pathlib, sys, types
tune = pathlib.Path(sys.argv[2]).parent
for name, path in (("slapo", tune.parent), ("slapo.tune", tune)):
    sys.modules[name] = pkg = types.ModuleType(name)
    pkg.__path__ = [str(path)]
from slapo.tune.database import Database
db = Database(sys.argv[1])
big = "x" * 20000  # large records make a torn write likely if writes were not atomic
i = 0
while True:
    db.commit(f"k{i}", {"i": i, "pad": big})
    print(i, flush=True)
    i += 1
"""


def test_killed_writer_leaves_a_loadable_file_with_every_acknowledged_record(tmp_path):
    path = tmp_path / "db.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), database.__file__],
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = -1
    deadline = time.monotonic() + 20
    while acked < 30 and time.monotonic() < deadline:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)  # mid-write, most likely
    proc.communicate()
    db = Database(path)
    keys = list(db)
    assert keys == [f"k{i}" for i in range(len(keys))]  # a prefix, nothing torn
    assert len(keys) >= acked + 1
    leftovers = [p for p in tmp_path.iterdir() if p.name != "db.json"]
    for p in leftovers:  # a temp file may survive SIGKILL, but never replaces the database
        assert p.name.startswith(".db.json.") and p.name.endswith(".tmp")
