"""The tokenizer of a run: the model directory's (or ``--tokenizer``'s), else one token per byte.

Both kinds answer the same few questions: the vocabulary size (checked against the model's
embeddings), the end-of-text id that joins documents, ``encode`` / ``decode``, and an
``identity`` that keys the token cache (two tokenizers that split text alike share it).

Example:
    >>> tok = ByteTokenizer()
    >>> tok.encode(["hi"]), tok.decode([104, 105])
    ([[104, 105]], 'hi')
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from ..data import MASK_ID, VOCAB_SIZE
from ..exceptions import InputError

__all__ = [
    "BYTE_EOS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "render_bytes",
]

#: The byte tokenizer's end of text: NUL never occurs in text (the built-in models' eos id too).
BYTE_EOS = 0
#: Files whose presence says a model directory carries a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    """What a run needs of a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def identity(self) -> str: ...


def render_bytes(ids: list[int]) -> str:
    """Byte ids as text, one character per byte: the mask shows as ``_``, any other byte that is
    not printable ASCII (or a newline or tab) as ``?``.

    Example:
        >>> render_bytes([100, 0, 10, 200])
        'd_\\n?'
    """
    chars = []
    for i in ids:
        c = chr(i)
        printable = c.isascii() and (c.isprintable() or c in "\n\t")
        chars.append("_" if i == MASK_ID else c if printable else "?")
    return "".join(chars)


class ByteTokenizer:
    """One token per UTF-8 byte (the built-in models' vocabulary of 256)."""

    name = "bytes"
    vocab_size = VOCAB_SIZE
    eos_id: int | None = BYTE_EOS

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return render_bytes(ids)

    def identity(self) -> str:
        return "bytes-v1"


class HFTokenizer:
    """A transformers tokenizer loaded from a directory (no special tokens added to text).

    Example:
        >>> import tokenizers
        >>> import transformers
        >>> vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
        >>> words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        >>> words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        >>> fast = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>")
        >>> tok = HFTokenizer(fast, "words")  # or AutoTokenizer.from_pretrained(a directory)
        >>> tok.encode(["hello world"]), tok.vocab_size, tok.eos_id
        ([[2, 3]], 4, 1)
    """

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = len(tokenizer)  # with the added tokens, unlike .vocab_size
        self.eos_id = tokenizer.eos_token_id

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def identity(self) -> str:
        """A hash of what decides the tokens: the class, the whole tokenizer pipeline
        (normalizer, pre-tokenizer, model) where it serializes, else the vocabulary, and eos."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        spec = (
            backend.to_str()
            if backend is not None
            else json.dumps(sorted(self.tokenizer.get_vocab().items()))
        )
        text = f"{type(self.tokenizer).__name__}\n{self.eos_id}\n{spec}"
        return "hf-" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def has_tokenizer(path: Path) -> bool:
    """Whether a model directory carries tokenizer files.

    Example:
        >>> from pathlib import Path
        >>> Path("my-model").mkdir()
        >>> has_tokenizer(Path("my-model"))
        False
        >>> _ = Path("my-model/tokenizer.json").write_text("{}")  # as save_pretrained writes
        >>> has_tokenizer(Path("my-model"))
        True
    """
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(flag: str | None, model_dir: Path | None) -> Tokenizer:
    """The run's tokenizer: ``--tokenizer``'s directory, else the model directory's when it has
    one, else :class:`ByteTokenizer`.

    Example:
        >>> load_tokenizer(None, None).name
        'bytes'
    """
    if flag is not None:
        path, what = Path(flag).expanduser(), f"--tokenizer {flag}"
        if not path.is_dir():
            raise InputError(
                f"{what}: no such directory; give a directory a tokenizer was "
                "saved to (tokenizer.save_pretrained(DIR))"
            )
    elif model_dir is not None and has_tokenizer(model_dir):
        path, what = model_dir, f"--model {model_dir}"
    else:
        return ByteTokenizer()
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise InputError(
            f"{what}: cannot load its tokenizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); pass --tokenizer "
            "DIR with one saved by tokenizer.save_pretrained"
        ) from exc
    return HFTokenizer(tokenizer, str(path))
