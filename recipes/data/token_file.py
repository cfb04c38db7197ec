"""Pre-tokenized token files: one flat array of token ids per (source content, tokenizer), cached on disk.

Every document's tokens are followed by the tokenizer's eos id. The file `tokens/<key>.bin` holds the raw ids
(uint16, or uint32 for vocabularies over 65536 ids) and `tokens/<key>.json` describes it. The sidecar is written
last and both are moved into place atomically, so a sidecar on disk always means a complete token file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from recipes.data.sources import iter_document_pieces, source_identity
from recipes.schema import DataConfig
from recipes.tokenizer import Tokenizer

# Bump when the file layout or the tokenization procedure changes: old cache entries then stop matching.
FORMAT_VERSION = 1

# Tokens buffered in Python before they are written out; bounds memory whatever the corpus size.
_FLUSH_TOKENS = 1 << 20


def prepare_token_file(config: DataConfig, tokenizer: Tokenizer) -> Path:
    """The cached token file for this source and tokenizer, tokenizing the corpus only when it is not cached yet."""
    source = source_identity(config)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, source, tokenizer.identity]).encode()).hexdigest()
    path = cache_root(config) / "tokens" / f"{key}.bin"
    meta = _read_complete_sidecar(path)
    if meta is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = _write_token_file(path, config=config, tokenizer=tokenizer, source=source)
    needed = config.seq_len + 1
    if meta["num_tokens"] < needed:
        raise ValueError(
            f"the corpus has {meta['num_tokens']} tokens, but data.seq_len={config.seq_len} needs at least {needed}; "
            "add text or lower data.seq_len"
        )
    return path


def open_token_file(path: Path) -> np.memmap:
    """Memory-map a token file written by `prepare_token_file` (read-only, dtype from its sidecar)."""
    meta = _read_complete_sidecar(Path(path))
    if meta is None:
        raise ValueError(f"{path} is not a complete token file (sidecar missing or wrong size); rebuild it")
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))


def cache_root(config: DataConfig) -> Path:
    """`data.cache_dir`, else `$CKPTLESS_CACHE`, else `~/.cache/ckptless`."""
    root = config.cache_dir or os.environ.get("CKPTLESS_CACHE") or "~/.cache/ckptless"
    return Path(root).expanduser()


def _read_complete_sidecar(path: Path) -> dict | None:
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        complete = path.stat().st_size == meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if complete else None


def _write_token_file(path: Path, *, config: DataConfig, tokenizer: Tokenizer, source: str) -> dict:
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    num_tokens = num_text_tokens = 0
    buffer: list[int] = []
    with _atomic_file(path) as file:
        for pieces in iter_document_pieces(config):
            for piece in pieces:
                ids = tokenizer.encode(piece)
                num_text_tokens += len(ids)
                buffer.extend(ids)
                if len(buffer) >= _FLUSH_TOKENS:
                    num_tokens += _flush(buffer, file, dtype)
            buffer.append(tokenizer.eos_id)
        num_tokens += _flush(buffer, file, dtype)
        if num_text_tokens == 0:
            raise ValueError(f"the corpus of data.source={config.source} is empty: it holds no text to train on")
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "source_identity": source,
        "tokenizer_identity": tokenizer.identity,
    }
    with _atomic_file(path.with_suffix(".json")) as file:
        file.write(json.dumps(meta, indent=1).encode())
    return meta


def _flush(buffer: list[int], file: BinaryIO, dtype: np.dtype) -> int:
    count = len(buffer)
    file.write(np.asarray(buffer, dtype=dtype).tobytes())
    buffer.clear()
    return count


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write to a temporary file beside `path`, moved into place only on success; a failure leaves no trace.

    Concurrent writers each fill their own temporary file; the last `os.replace` wins, with identical content.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            # Before the rename: after a power loss the name must not point at blocks never written.
            os.fsync(file.fileno())
        # mkstemp makes the file private; a cache shared by a team must stay readable.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
