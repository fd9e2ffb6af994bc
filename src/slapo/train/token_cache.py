"""``--data`` as one stream of tokens, tokenized once and memory-mapped from a cache file.

The documents of the data files are tokenized, each followed by the end-of-text token, and
written to ``.slapo-cache/<name>.<key>.tokens`` beside the data: raw little-endian ``uint16``
(``int32`` for vocabularies beyond 65,536) ids. The key hashes the tokenizer's identity, the
field read and every file's name and content, so editing a file or switching tokenizers makes a
new cache, and a second run of the same data memory-maps the file without tokenizing anything.
The file appears atomically (written aside, then renamed), so concurrent runs (ranks of one
torchrun) at worst tokenize twice.

Example:
    >>> from pathlib import Path
    >>> from slapo.train.tokenizer import ByteTokenizer
    >>> _ = Path("corpus.jsonl").write_text('{"text": "hi"}\\n{"text": "yo"}\\n')
    >>> data = load_tokens("corpus.jsonl", "text", ByteTokenizer())
    >>> data.tokens.dtype, data.cached, data.tokens.tolist()  # 0: end of text
    (torch.uint16, False, [104, 105, 0, 121, 111, 0])
    >>> load_tokens("corpus.jsonl", "text", ByteTokenizer()).cached  # the second run
    True
"""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..exceptions import InputError
from .datafiles import Piece, data_files, read_pieces
from .tokenizer import Tokenizer

__all__ = ["TokenData", "cache_key", "cache_path", "load_tokens", "tokenize", "tokens_of_text"]

CACHE_DIR = ".slapo-cache"
FORMAT = "slapo-tokens-v1"
HASH_BLOCK = 1 << 22


@dataclass
class TokenData:
    """The token stream of ``--data``: ``tokens`` (1-D, memory-mapped when ``path`` is set) and
    whether it came from the cache without tokenizing."""

    tokens: torch.Tensor
    path: Path | None
    cached: bool


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype of the cache file that holds every id of the vocabulary.

    Example:
        >>> token_dtype(50_257), token_dtype(151_936)
        (torch.uint16, torch.int32)
    """
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


def _file_hash(file: Path) -> str:
    h = hashlib.sha256()
    try:
        with file.open("rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
    except OSError as exc:
        raise InputError(
            f"--data {file}: cannot read it ({exc.strerror or exc}); check that it "
            "is a readable file"
        ) from exc
    return h.hexdigest()


def cache_key(root: Path, files: list[Path], field: str, tokenizer: Tokenizer) -> str:
    """The hash that names the cache of ``files`` (under ``root``) tokenized by ``tokenizer``.

    Example:
        >>> from pathlib import Path
        >>> from slapo.train.tokenizer import ByteTokenizer
        >>> _ = Path("a.txt").write_text("some text")
        >>> len(cache_key(Path("a.txt"), [Path("a.txt")], "text", ByteTokenizer()))
        24
    """
    h = hashlib.sha256(f"{FORMAT}\n{tokenizer.identity()}\n{field}\n".encode())
    for file in files:
        name = file.name if file == root else str(file.relative_to(root))
        h.update(f"{name}\n{_file_hash(file)}\n".encode())
    return h.hexdigest()[:24]


def cache_path(root: Path, key: str) -> Path:
    """Where the tokens of ``--data root`` with ``key`` are cached: beside ``root``.

    Example:
        >>> from pathlib import Path
        >>> cache_path(Path("/data/train.jsonl"), "abc")  # a relative root is made absolute
        PosixPath('/data/.slapo-cache/train.jsonl.abc.tokens')
    """
    root = root.expanduser().absolute()
    return root.parent / CACHE_DIR / f"{root.name}.{key}.tokens"


def tokenize(tokenizer: Tokenizer, pieces: list[Piece]) -> list[int]:
    """The ids of a batch of pieces, the end-of-text id after each document's last piece.

    Example:
        >>> from slapo.train.tokenizer import ByteTokenizer
        >>> tokenize(ByteTokenizer(), [("hi", True), ("a", False)])
        [104, 105, 0, 97]
    """
    ids: list[int] = []
    for piece_ids, (_, ends) in zip(tokenizer.encode([text for text, _ in pieces]), pieces):
        ids.extend(piece_ids)
        if ends and tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
    return ids


def _write(files: list[Path], field: str, tokenizer: Tokenizer, out: Path) -> int:
    """Tokenize ``files`` into ``out``, one piece's ids at a time (no list of a whole batch's
    ids: the file streams); returns the number of tokens written."""
    # little-endian, as torch.from_file reads them on the (little-endian) hosts torch runs on
    dtype = "<u2" if token_dtype(tokenizer.vocab_size) == torch.uint16 else "<i4"
    eos = None if tokenizer.eos_id is None else np.asarray([tokenizer.eos_id], dtype=dtype)
    count = 0
    with out.open("wb") as f:
        for file in files:
            for pieces in read_pieces(file, field):
                encoded = tokenizer.encode([text for text, _ in pieces])
                for (_, ends), ids in zip(pieces, encoded):
                    np.asarray(ids, dtype=dtype).tofile(f)
                    count += len(ids)
                    if ends and eos is not None:
                        eos.tofile(f)
                        count += 1
                del encoded
    return count


def _map(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """The cache file as a tensor whose pages are read on demand (private: never written)."""
    count = path.stat().st_size // torch.empty((), dtype=dtype).element_size()
    return torch.from_file(str(path), shared=False, size=count, dtype=dtype)


def load_tokens(data: str, field: str, tokenizer: Tokenizer) -> TokenData:
    """The tokens of ``--data data``: from the cache when it holds them, else tokenized and
    cached (where the data's folder is not writable: kept in memory, with a note on stderr).

    Example:
        >>> from pathlib import Path
        >>> from slapo.train.tokenizer import ByteTokenizer
        >>> Path("corpus").mkdir()
        >>> _ = Path("corpus/a.txt").write_text("x" * 1000)
        >>> load_tokens("corpus/", "text", ByteTokenizer()).tokens.shape  # and end of text
        torch.Size([1001])
    """
    root = Path(data).expanduser()
    files = data_files(data)
    dtype = token_dtype(tokenizer.vocab_size)
    path = cache_path(root, cache_key(root, files, field, tokenizer))
    if path.is_file():
        return TokenData(_map(path, dtype), path, cached=True)
    # a name of this process's own: ranks of one torchrun may tokenize at the same time
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        tmp.touch(exist_ok=False)
    except OSError as exc:
        print(
            f"slapo train: no token cache for --data {data} ({exc.strerror or exc}): "
            "tokenized in memory",
            file=sys.stderr,
        )
        return _in_memory(files, field, tokenizer, data)
    try:
        count = _write(files, field, tokenizer, tmp)
        if count == 0:
            raise InputError(f"--data {data} holds no text; give files with text in them")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return TokenData(_map(path, dtype), path, cached=False)


def _in_memory(files: list[Path], field: str, tokenizer: Tokenizer, data: str) -> TokenData:
    ids = [
        i
        for file in files
        for pieces in read_pieces(file, field)
        for i in tokenize(tokenizer, pieces)
    ]
    if not ids:
        raise InputError(f"--data {data} holds no text; give files with text in them")
    return TokenData(torch.tensor(ids, dtype=torch.int32), None, cached=False)


def tokens_of_text(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """A text (the embedded corpus) tokenized in memory, in pieces cut at line ends.

    Example:
        >>> from slapo.train.tokenizer import ByteTokenizer
        >>> tokens_of_text("def f():\\n    pass\\n", ByteTokenizer()).dtype
        torch.int32
    """
    lines = text.splitlines(keepends=True)
    pieces: list[Piece] = []
    for start in range(0, len(lines), 2000):  # pieces of 2000 lines: one document
        pieces.append(("".join(lines[start : start + 2000]), False))
    return torch.tensor(tokenize(tokenizer, pieces), dtype=torch.int32)
