"""A small JSON database of tuning results that survives crashes.

Every commit rewrites the whole file through a temporary file in the same directory, fsync
and ``os.replace``, so a reader sees either the old file or the new one, never half of one.
JSON (never pickle): the file is readable, diffable and safe to load from anywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from .errors import DatabaseCorruptError, TuneTypeError

_FORMAT = "slapo-tune-db"
_VERSION = 1


class Database:
    """Records keyed by string, stored as JSON in ``db_file_name`` (in memory only if None).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "results.json")
        >>> db = Database(path)
        >>> db.commit('{"batch_size": 8}', {"status": "ok", "throughput": 12.5})
        >>> Database(path)['{"batch_size": 8}']["throughput"]
        12.5
    """

    def __init__(self, db_file_name: str | os.PathLike[str] | None = None) -> None:
        if db_file_name is not None and not isinstance(db_file_name, (str, os.PathLike)):
            raise TuneTypeError(
                f"db_file_name must be a path or None, got db_file_name={db_file_name!r}"
            )
        self.db_file_name = os.fspath(db_file_name) if db_file_name is not None else None
        self.db: dict[str, Any] = self._read() if self.db_file_name else {}

    def _read(self) -> dict[str, Any]:
        """Load the records from disk; a missing file is an empty database."""
        path = self.db_file_name
        assert path is not None
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatabaseCorruptError(
                f"Tuning database {path!r} is not valid JSON ({e}); it was left untouched. "
                "Fix or move it away, or pass another --db."
            ) from e
        if (
            not isinstance(doc, dict)
            or doc.get("format") != _FORMAT
            or not isinstance(doc.get("records"), dict)
        ):
            raise DatabaseCorruptError(
                f"Tuning database {path!r} is JSON but not a Slapo tuning database "
                f"(expected an object with format={_FORMAT!r} and a 'records' object); "
                "it was left untouched."
            )
        if doc.get("version") != _VERSION:
            raise DatabaseCorruptError(
                f"Tuning database {path!r} has version {doc.get('version')!r}; "
                f"this Slapo reads version {_VERSION}."
            )
        return doc["records"]

    def load(self) -> None:
        """Re-read the file, replacing the records held in memory."""
        if self.db_file_name:
            self.db = self._read()

    def commit(self, key: str, data: Any) -> None:
        """Store ``data`` under ``key`` and write the file atomically.

        Records committed by another ``Database`` on the same file since this one loaded are
        kept: the file is re-read (and checked) just before it is replaced.
        """
        if not isinstance(key, str):
            raise TuneTypeError(f"key must be a str, got key={key!r} ({type(key).__name__})")
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TuneTypeError(f"data for key {key!r} is not JSON-serializable: {e}") from e
        if self.db_file_name:
            merged = self._read()  # raises before writing if the file went bad meanwhile
            merged.update(self.db)
            merged[key] = data
            self._write(merged)
            self.db = merged
        else:
            self.db[key] = data

    def save(self) -> None:
        """Write the records held in memory (merged with the file's) atomically.

        Commits write the file already; this also creates it when nothing was committed yet, so
        an interrupted run always leaves a readable database behind.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "results.json")
            >>> Database(path).save()
            >>> len(Database(path))
            0
        """
        if self.db_file_name:
            merged = self._read()
            merged.update(self.db)
            self._write(merged)
            self.db = merged

    def _write(self, records: dict[str, Any]) -> None:
        path = self.db_file_name
        assert path is not None
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        doc = {"format": _FORMAT, "version": _VERSION, "records": records}
        fd, tmp = tempfile.mkstemp(
            dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1, allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        # Persist the rename itself; some filesystems do not support fsync on a directory.
        try:
            dir_fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)

    # ----- mapping-style read access ------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.db[key]

    def get(self, key: str, default: Any = None) -> Any:
        """Return the record of ``key`` or ``default``."""
        return self.db.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.db

    def __len__(self) -> int:
        return len(self.db)

    def __iter__(self) -> Iterator[str]:
        return iter(self.db)

    def items(self) -> list[tuple[str, Any]]:
        """All ``(key, record)`` pairs, in commit order."""
        return list(self.db.items())

    def __repr__(self) -> str:
        return f"Database({self.db_file_name!r}, {len(self.db)} records)"
