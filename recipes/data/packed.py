"""Packed conversation files: every conversation in its chat template, packed into rows of `seq_len + 1` tokens.

Conversations are packed first-fit in their source order: each goes into the row being filled when it fits, else
starts a new row (one longer than a row is cut to it, and counted; dropped if that leaves none of its answer); the
rest of a row is padding. Beside the
tokens each row keeps, per token, its position within its conversation (0 where one starts: the model is given
these position ids and attends within a conversation only) and whether it is trained (the assistant's tokens).

`packed/<key>/` holds `tokens.bin`, `positions.bin` and `trained.bin` (raw arrays, `[rows, seq_len + 1]`),
`targets.bin` (per row, the trained tokens that are targets: all but a conversation's first) and `meta.json`,
written last; the directory is built beside its place and renamed into it, so a `meta.json` always
means a complete file set.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from recipes.data.chat import SYNTHETIC_CHAT_VERSION, iter_conversations
from recipes.data.sources import source_identity
from recipes.data.token_file import cache_root
from recipes.schema import DataConfig
from recipes.tokenizer import Tokenizer

# Bump when the layout or the packing changes: old cache entries then stop matching.
FORMAT_VERSION = 1

_ROWS_PER_WRITE = 4096


def prepare_packed_file(config: DataConfig, tokenizer: Tokenizer) -> Path:
    """The cached packed directory for this source, tokenizer and `data.seq_len`, packing only when not cached."""
    source = source_identity(config)
    identity = [FORMAT_VERSION, SYNTHETIC_CHAT_VERSION, source, config.messages_field, tokenizer.identity]
    key = hashlib.sha256(json.dumps([*identity, config.seq_len]).encode()).hexdigest()
    directory = cache_root(config) / "packed" / key
    if not (directory / "meta.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        _write_packed(directory, config=config, tokenizer=tokenizer)
    return directory


def read_packed(directory: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """`meta.json`, and the arrays by name memory-mapped read-only: tokens, positions and trained flags as
    `[rows, seq_len + 1]`, targets as `[rows]`."""
    meta = json.loads((directory / "meta.json").read_text())
    shapes = {name: (meta["rows"], meta["row_len"]) for name in ("tokens", "positions", "trained")}
    shapes["targets"] = (meta["rows"],)
    arrays = {
        name: np.memmap(directory / f"{name}.bin", dtype=meta[f"{name}_dtype"], mode="r", shape=shape)
        for name, shape in shapes.items()
    }
    return meta, arrays


def _write_packed(directory: Path, *, config: DataConfig, tokenizer: Tokenizer) -> None:
    row_len = config.seq_len + 1
    dtypes = {
        "tokens": np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32),
        "positions": np.dtype(np.uint16 if row_len <= 1 << 16 else np.uint32),
        "trained": np.dtype(np.uint8),
        "targets": np.dtype(np.uint32),
    }
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        files = {name: (staging / f"{name}.bin").open("wb") for name in dtypes}
        rows = conversations = truncated = dropped = trained_tokens = 0
        pending: dict[str, list[np.ndarray]] = {name: [] for name in dtypes}
        row = _Row(row_len, pad_id=tokenizer.eos_id)
        for conversation in iter_conversations(config):
            ids, trained = [], []
            for segment, is_trained in tokenizer.chat_segments(conversation):
                ids += segment
                trained += [is_trained] * len(segment)
            conversations += 1
            if len(ids) > row_len:
                truncated += 1
                ids, trained = ids[:row_len], trained[:row_len]
                if not any(trained[1:]):  # cut before its first answer: nothing to train on
                    dropped += 1
                    continue
            if not row.fits(len(ids)):
                rows += row.flush(pending)
                if len(pending["tokens"]) >= _ROWS_PER_WRITE:
                    trained_tokens += _write(pending, files, dtypes)
            row.add(ids, trained)
        rows += row.flush(pending)
        trained_tokens += _write(pending, files, dtypes)
        for file in files.values():
            file.close()
        if trained_tokens == 0:
            raise ValueError(f"the conversations of data.source={config.source} hold no assistant tokens to train on")
        meta = {
            "format_version": FORMAT_VERSION,
            "rows": rows,
            "row_len": row_len,
            "conversations": conversations,
            "truncated": truncated,
            "dropped": dropped,
            "trained_tokens": trained_tokens,
            "tokenizer_identity": tokenizer.identity,
            **{f"{name}_dtype": dtype.name for name, dtype in dtypes.items()},
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        staging.chmod(0o755)  # mkdtemp makes it private; a cache shared by a team must stay readable
        try:
            staging.rename(directory)
        except OSError:  # another process packed the same source first: identical content
            if not (directory / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Row:
    """The row being filled: tokens, their positions within their conversation, and their trained flags."""

    def __init__(self, length: int, *, pad_id: int) -> None:
        self.length, self.pad_id = length, pad_id
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.trained: list[bool] = []

    @property
    def used(self) -> int:
        return len(self.tokens)

    def fits(self, count: int) -> bool:
        return self.used + count <= self.length

    def add(self, ids: list[int], trained: list[bool]) -> None:
        self.tokens += ids
        self.positions += range(len(ids))
        self.trained += trained

    def flush(self, pending: dict[str, list[np.ndarray]]) -> int:
        """Pad to the row length (padding: its own run of positions from 0, never trained), queue it, start over."""
        if not self.used:
            return 0
        pad = self.length - self.used
        pending["tokens"].append(np.array(self.tokens + [self.pad_id] * pad))
        pending["positions"].append(np.array(self.positions + list(range(pad))))
        pending["trained"].append(np.array(self.trained + [False] * pad))
        # A conversation's first token (position 0) is no target: its input is the previous one's last token.
        pending["targets"].append(np.array(sum(t and p > 0 for t, p in zip(self.trained, self.positions, strict=True))))
        self.tokens, self.positions, self.trained = [], [], []
        return 1


def _write(pending: dict[str, list[np.ndarray]], files: dict, dtypes: dict[str, np.dtype]) -> int:
    """Append the queued rows to their files; the number of targets they hold."""
    targets = int(sum(pending["targets"]))
    for name, rows in pending.items():
        if rows:
            files[name].write(np.stack(rows).astype(dtypes[name]).tobytes())
        rows.clear()
    return targets
