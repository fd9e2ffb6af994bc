"""``--data``: the files a run trains on, and their text, read in pieces.

A ``.txt`` file is one document; a ``.jsonl`` file holds one document per record (its
``--data-field``, ``text`` by default); a ``.parquet`` file one per row of that column (with
``pyarrow``); a directory, every such file under it (hidden ones skipped), in sorted order.
What cannot be used raises an :class:`~slapo.train.config.InputError` naming the file and how
to fix it.

Example:
    >>> from pathlib import Path
    >>> Path("corpus").mkdir()
    >>> _ = Path("corpus/a.txt").write_text("def f():\\n    return 1\\n")
    >>> _ = Path("corpus/b.jsonl").write_text('{"text": "hello"}\\n{"text": "world"}\\n')
    >>> files = data_files("corpus/")
    >>> files
    [PosixPath('corpus/a.txt'), PosixPath('corpus/b.jsonl')]
    >>> pieces = [p for f in files for batch in read_pieces(f, "text") for p in batch]
    >>> pieces
    [('def f():\\n    return 1\\n', True), ('hello', True), ('world', True)]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..exceptions import InputError

__all__ = ["SUFFIXES", "Piece", "data_files", "read_pieces"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Pieces per batch handed to the tokenizer, and the most characters of a batch (a batch is handed
#: over once either is reached, so that a corpus larger than memory streams: the tokenizer's
#: output for one batch is all that is held at once), and the characters of a ``.txt`` piece (a
#: long file is tokenized a piece at a time, cut at line ends).
BATCH_PIECES = 512
BATCH_CHARS = 1 << 21
TXT_PIECE_CHARS = 1 << 18

#: A piece of text, and whether a document ends with it (the end-of-text token follows).
Piece = tuple[str, bool]


def data_files(data: str) -> list[Path]:
    """The files ``--data data`` names: itself, or every data file under a directory.

    Example:
        >>> from pathlib import Path
        >>> _ = Path("notes.txt").write_text("one document\\n")
        >>> data_files("notes.txt")
        [PosixPath('notes.txt')]
    """
    path = Path(data).expanduser()
    if not path.exists():
        raise InputError(f"--data {data}: no such file or directory")
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in SUFFIXES
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise InputError(
                f"--data {data} holds no {', '.join(SUFFIXES)} file; put the text "
                "in such files (one document per .txt file or per record)"
            )
        return files
    if path.suffix not in SUFFIXES:
        raise InputError(
            f"--data {data}: unknown format {path.suffix or '(no suffix)'!r}; give a "
            ".txt, .jsonl or .parquet file, or a directory of them"
        )
    return [path]


def read_pieces(file: Path, field: str) -> Iterator[list[Piece]]:
    """The text of one data file, in batches of pieces.

    Raises an :class:`InputError` for a file that cannot be read, is empty, is not UTF-8 or
    not JSON lines, or where no record has ``field``.
    """
    try:
        if file.stat().st_size == 0:
            raise InputError(f"--data {file} is empty; give a file with text in it")
        if file.suffix == ".txt":
            yield from _batches(_txt(file))
        elif file.suffix == ".jsonl":
            yield from _batches(_jsonl(file, field))
        else:
            yield from _parquet(file, field)
    except UnicodeDecodeError as exc:
        raise InputError(
            f"--data {file}: not UTF-8 text ({exc.reason} at byte {exc.start} of "
            "a piece); convert it to UTF-8 (iconv -t utf-8)"
        ) from exc
    except OSError as exc:
        raise InputError(
            f"--data {file}: cannot read it ({exc.strerror or exc}); check that it "
            "is a readable file"
        ) from exc


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """``pieces`` in batches for the tokenizer: :data:`BATCH_PIECES` pieces, or fewer that hold
    :data:`BATCH_CHARS` characters.

    Example:
        >>> [len(b) for b in _batches(iter([("a" * BATCH_CHARS, True), ("b", True)]))]
        [1, 1]
    """
    batch: list[Piece] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) >= BATCH_PIECES or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _txt(file: Path) -> Iterator[Piece]:
    """One document, in pieces of about :data:`TXT_PIECE_CHARS` cut after a newline."""
    with file.open(encoding="utf-8") as f:
        pending = f.read(TXT_PIECE_CHARS)
        while pending:
            more = f.read(TXT_PIECE_CHARS)
            cut = pending.rfind("\n") + 1 if more else len(pending)
            cut = cut or len(pending)  # no newline in the piece: cut anywhere
            yield pending[:cut], not more and cut == len(pending)
            pending = pending[cut:] + more


def _jsonl(file: Path, field: str) -> Iterator[Piece]:
    """One document per record's ``field`` (records without it are skipped)."""
    found, seen = False, set()
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise InputError(
                    f"--data {file} line {number} is not JSON ({exc}); a .jsonl "
                    "file holds one JSON object per line"
                ) from exc
            if not isinstance(record, dict):
                raise InputError(
                    f"--data {file} line {number} is a JSON {type(record).__name__}, not an object"
                )
            if field not in record:
                seen.update(record)
                continue
            found = True
            text = record[field]
            if not text:  # null or "": no document (not even its end-of-text token)
                continue
            if not isinstance(text, str):
                raise InputError(
                    f"--data {file} line {number}: field {field!r} is a "
                    f"{type(text).__name__}, not text; pick a text field with "
                    "--data-field"
                )
            yield text, True
    if not found:
        raise _no_field(file, field, sorted(seen))


def _parquet(file: Path, field: str) -> Iterator[list[Piece]]:
    """One document per row of column ``field``."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InputError(
            f"--data {file}: reading .parquet needs pyarrow, which is not "
            "installed: pip install pyarrow (or give .txt / .jsonl data)"
        ) from exc
    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own error types)
        raise InputError(f"--data {file}: not a parquet file pyarrow reads ({exc})") from exc
    columns = parquet.schema_arrow.names
    if field not in columns:
        raise _no_field(file, field, columns)
    for record_batch in parquet.iter_batches(batch_size=BATCH_PIECES, columns=[field]):
        texts = record_batch.column(0).to_pylist()
        if any(t is not None and not isinstance(t, str) for t in texts):
            raise InputError(
                f"--data {file}: column {field!r} does not hold text; pick a text "
                "column with --data-field"
            )
        yield [(t, True) for t in texts if t]


def _no_field(file: Path, field: str, fields: list[str]) -> InputError:
    hint = f"its records have {', '.join(map(repr, fields[:8]))}" if fields else "it has none"
    flag = f"--data-field {fields[0]}" if fields else "--data-field"
    return InputError(f"--data {file}: no record has the field {field!r} ({hint}); pass {flag}")
