"""Where training text comes from: validating `data.*`, reading documents, and naming a source's content.

Sources: `synthetic` (the built-in corpus), `text_files` (one document per file) and `hf_dataset` (Hugging Face
`datasets`, from local files or a hub name). `datasets` is imported only when an `hf_dataset` is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from recipes.data.synthetic import SYNTHETIC_VERSION, synthetic_text
from recipes.schema import DataConfig

SOURCES = ("synthetic", "text_files", "hf_dataset", "chat")
TASKS = ("pretrain", "sft", "lora")
_TEXT_SOURCES = ("text_files", "hf_dataset")

# Local file extension -> `datasets` builder for `hf_dataset` with `data.paths`.
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst"}

# Documents larger than this are handed to the tokenizer in pieces (cut at line ends) to bound memory.
_PIECE_CHARS = 1 << 20


def check_data_config(config: DataConfig, *, task: str = "pretrain") -> None:
    """Refuse a `data` section that cannot work for `task`, with a message naming the field; cheap (reads no
    data). Pretraining reads text (`synthetic`, `text_files`, `hf_dataset`), fine-tuning conversations
    (`synthetic`, `chat`)."""
    if config.source not in SOURCES:
        raise ValueError(f"data.source={config.source!r} is not one of {', '.join(SOURCES)}")
    if task not in TASKS:
        raise ValueError(f"task.kind={task!r} is not one of {', '.join(TASKS)} (task=<kind>)")
    if task == "pretrain" and config.source == "chat":
        raise ValueError("data=chat holds conversations, which task=sft and task=lora train on; add task=sft")
    if task != "pretrain" and config.source in _TEXT_SOURCES:
        raise ValueError(
            f"task={task} trains on conversations, and data.source={config.source} is plain text: use data=chat "
            "(files of messages), data=synthetic (built-in conversations), or task=pretrain"
        )
    if config.seq_len < 1:
        raise ValueError(f"data.seq_len={config.seq_len} must be >= 1")
    if config.source == "synthetic":
        if config.paths or config.name:
            raise ValueError(
                "data.source=synthetic ignores data.paths and data.name, but one is set; "
                "set data.source=text_files or hf_dataset to train on them, or clear them"
            )
        if config.synthetic_num_bytes < 1:
            raise ValueError(f"data.synthetic_num_bytes={config.synthetic_num_bytes} must be >= 1")
        return
    if config.source == "text_files" and not config.paths:
        raise ValueError("data.source=text_files needs data.paths: a list of UTF-8 text files")
    if config.source in ("hf_dataset", "chat"):
        if not config.paths and not config.name:
            raise ValueError(
                f"data.source={config.source} needs data.paths (local files) or data.name (a local dataset "
                "directory, or a hub dataset)"
            )
        if config.paths and config.name:
            raise ValueError(
                f"data.source={config.source} takes data.paths or data.name, not both; set the other to null"
            )
    if config.name and config.name.startswith(("/", ".", "~")) and not Path(config.name).expanduser().is_dir():
        raise ValueError(
            f"data.name={config.name!r} looks like a path but is not a directory; name a local dataset directory "
            "(save_to_disk's, or one of data files) or a hub dataset"
        )
    for path in config.paths:
        if not Path(path).expanduser().is_file():
            raise ValueError(f"data.paths: {path!r} does not exist or is not a file")
    if config.source in ("hf_dataset", "chat") and config.paths:
        builder = builder_for(config.paths)
        if config.source == "chat" and builder not in ("json", "parquet"):
            raise ValueError(f"data=chat reads conversations from .jsonl, .json or .parquet files, not {builder} files")


def iter_texts(config: DataConfig) -> Iterator[str]:
    """Every document of the source, in a fixed order."""
    for pieces in iter_document_pieces(config):
        yield "".join(pieces)


def iter_document_pieces(config: DataConfig) -> Iterator[Iterator[str]]:
    """Every document as an iterator of text pieces, so a 1 GB document never sits in memory whole.

    Pieces are cut after a newline, so tokenizers that split on whitespace see the same words.
    """
    if config.source == "synthetic":
        yield _pieces(synthetic_text(seed=0, num_bytes=config.synthetic_num_bytes))
    elif config.source == "text_files":
        for path in config.paths:
            yield _file_pieces(Path(path).expanduser())
    elif config.source == "hf_dataset":
        for text in _iter_hf_dataset(config):
            yield _pieces(text)
    else:
        raise ValueError(f"data.source={config.source!r} is not one of {', '.join(SOURCES)}")


def source_identity(config: DataConfig) -> str:
    """A string that changes when the source's content changes (files: absolute path, size and mtime, not content)."""
    if config.source == "synthetic":
        parts: dict = {"source": "synthetic", "version": SYNTHETIC_VERSION, "num_bytes": config.synthetic_num_bytes}
    else:
        files = [Path(p) for p in config.paths]
        if config.name and Path(config.name).expanduser().is_dir():  # a local dataset: every file in it
            files = sorted(f for f in Path(config.name).expanduser().rglob("*") if f.is_file())
        parts = {"source": config.source, "files": [_file_identity(f) for f in files]}
        if config.source == "hf_dataset":
            parts.update(name=config.name, split=config.split, text_field=config.text_field)
        if config.source == "chat":
            parts.update(name=config.name, split=config.split, messages_field=config.messages_field)
    return json.dumps(parts, sort_keys=True)


def _file_identity(path: Path) -> list:
    # size + mtime_ns, like make: hashing the content would read the whole corpus on every launch and every rank.
    stat = path.expanduser().stat()
    return [str(path.expanduser().resolve()), stat.st_size, stat.st_mtime_ns]


def builder_for(paths: list[str]) -> str:
    builders = set()
    for path in paths:
        suffixes = [s.lower() for s in Path(path).suffixes]
        if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
            suffixes.pop()
        suffix = suffixes[-1] if suffixes else ""
        if suffix not in _BUILDERS:
            raise ValueError(
                f"data.paths: cannot tell the format of {path!r} from its extension; "
                f"use one of {', '.join(sorted(_BUILDERS))} (optionally compressed)"
            )
        builders.add(_BUILDERS[suffix])
    if len(builders) > 1:
        raise ValueError(f"data.paths mixes formats ({', '.join(sorted(builders))}); use files of one format")
    return builders.pop()


def load_rows(config: DataConfig) -> Iterable[dict]:
    """The rows of a `datasets` source (`hf_dataset`, `chat`): local files (`data.paths`, filed under `data.split`,
    so any split name works for them), a local dataset directory (`data.name`: one `save_to_disk` wrote, or data
    files `load_dataset` reads), or a hub dataset (`data.name`, needs the network)."""
    import datasets

    # Streaming reads rows once without building an Arrow copy of the corpus in the HF cache: the token file is
    # the only copy this project keeps.
    if config.paths:
        paths = [str(Path(p).expanduser()) for p in config.paths]
        return datasets.load_dataset(
            builder_for(config.paths), data_files={config.split: paths}, split=config.split, streaming=True
        )
    local = Path(config.name).expanduser()
    if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():  # save_to_disk's layout
        saved = datasets.load_from_disk(str(local))
        if isinstance(saved, datasets.DatasetDict):
            if config.split not in saved:
                raise ValueError(
                    f"data.name={config.name!r} has no split {config.split!r} (it has {', '.join(saved)}); set "
                    "data.split"
                )
            saved = saved[config.split]
        return saved
    return datasets.load_dataset(config.name, split=config.split, streaming=True)


def _iter_hf_dataset(config: DataConfig) -> Iterator[str]:
    for row in load_rows(config):
        if config.text_field not in row:
            raise ValueError(
                f"data.text_field={config.text_field!r} is not a column of the dataset; its columns are "
                f"{', '.join(map(repr, row))}"
            )
        text = row[config.text_field]
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"data.text_field={config.text_field!r} holds {type(text).__name__} values, not text; "
                "point it at a string column"
            )
        yield text


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = start + _PIECE_CHARS
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline >= start else end
        yield text[start:end]
        start = end


def _file_pieces(path: Path) -> Iterator[str]:
    try:
        with path.open("r", encoding="utf-8") as file:
            pending = ""
            while chunk := file.read(_PIECE_CHARS):
                pending += chunk
                newline = pending.rfind("\n")
                if newline >= 0:
                    yield pending[: newline + 1]
                    pending = pending[newline + 1 :]
                elif len(pending) >= _PIECE_CHARS:
                    yield pending
                    pending = ""
            if pending:
                yield pending
    except UnicodeDecodeError as error:
        raise ValueError(f"data.paths: {str(path)!r} is not UTF-8 text ({error}); convert it to UTF-8") from error
