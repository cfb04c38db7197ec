"""Tokenizers: the built-in byte-level one for tiny recipes and any local Hugging Face tokenizer.

Both expose the same small surface the data pipeline needs: `encode`, `decode`, `chat_segments` (a conversation in
its chat template, as token runs marked trained or not), `eos_id`, `vocab_size` and an `identity` string that
changes whenever the tokenizer would produce different ids (token-file cache keys use it); and `save_pretrained`,
their files as transformers loads them (the byte-level one as a transformers tokenizer of the same ids), which
every run writes into its `hf/`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from recipes.schema import TokenizerConfig


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    @property
    def identity(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def chat_segments(self, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]: ...


END_TOKEN = "<|endoftext|>"
"""The byte-level tokenizer's end id (256) as transformers' tokenizer writes it (its bos and pad token too)."""

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""`ByteTokenizer.chat_segments`'s template in Jinja, as `apply_chat_template` renders it."""


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 marks the end of a document."""

    eos_id = 256
    vocab_size = 257

    @property
    def identity(self) -> str:
        return "byte-level-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eos_id).decode("utf-8", errors="replace")

    def chat_segments(self, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
        """The built-in chat template: each message is `<|role|>` and a newline, then its content and a newline;
        an assistant's content is trained, followed by the end id (256), which is trained too, so the model learns
        to stop."""
        segments: list[tuple[list[int], bool]] = []
        for message in messages:
            answer = message["role"] == "assistant"
            segments.append((self.encode(f"<|{message['role']}|>\n"), False))
            segments.append((self.encode(message["content"] + "\n") + ([self.eos_id] if answer else []), answer))
        return segments

    def save_pretrained(self, directory: Path) -> None:
        """Its files, as `AutoTokenizer.from_pretrained(directory)` reads them (`transformers_byte_tokenizer`)."""
        transformers_byte_tokenizer().save_pretrained(str(directory))


def transformers_byte_tokenizer():
    """The byte-level tokenizer as a transformers tokenizer with the same ids, chat template included: a byte-level
    BPE without merges whose vocabulary is the 256 bytes in order (byte b is id b), and `END_TOKEN` the special token
    256 (eos, bos and pad; nothing adds it to what is encoded, as `encode` adds nothing). Unlike `encode`, it reads
    the text `<|endoftext|>` as that token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()  # the printable character that stands for each byte in a byte-level vocabulary
    tokenizer = Tokenizer(models.BPE(vocab={symbols[byte]: byte for byte in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_TOKEN,
        bos_token=END_TOKEN,
        pad_token=END_TOKEN,
        chat_template=BYTE_CHAT_TEMPLATE,
    )


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from the hub)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        if self._tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer in {self.path} has no eos token; documents are separated by it. "
                "Set `eos_token` in its tokenizer_config.json."
            )
        self.eos_id: int = int(self._tokenizer.eos_token_id)
        self.vocab_size: int = len(self._tokenizer)
        self._identity = "hf-" + _hash_directory(self.path)

    @property
    def identity(self) -> str:
        return self._identity

    def encode(self, text: str) -> list[int]:
        # verbose=False: token files are long streams, the model_max_length warning does not apply to them.
        return self._tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids if int(i) != self.eos_id])

    def chat_segments(self, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
        """The conversation in the tokenizer's own chat template, cut where each assistant turn starts and ends:
        an assistant's turn as the template renders it after the generation prompt (its content and end-of-turn
        marker) is trained, everything else (system and user turns, role headers) is not."""
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"the tokenizer in {self.path} has no chat template (chat_template in tokenizer_config.json or "
                "chat_template.jinja), which task=sft and task=lora render conversations with; add one"
            )
        segments: list[tuple[list[int], bool]] = []
        done = ""
        for turn, message in enumerate(messages):
            answer = message["role"] == "assistant"
            prompt = self._render(messages[:turn], generation_prompt=True) if answer else done
            rendered = self._render(messages[: turn + 1], generation_prompt=False)
            if not (prompt.startswith(done) and rendered.startswith(prompt)):
                raise ValueError(
                    f"the chat template of the tokenizer in {self.path} does not render a conversation as the "
                    f"renderings of its beginnings extended (message {turn + 1} changes what came before), so the "
                    "assistant's tokens cannot be told apart; use a template that only appends"
                )
            segments.append((self.encode(prompt[len(done) :]), False))
            segments.append((self.encode(rendered[len(prompt) :]), answer))
            done = rendered
        return [(ids, trained) for ids, trained in segments if ids]

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        if not messages and not generation_prompt:
            return ""
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def save_pretrained(self, directory: Path) -> None:
        """Its files, as `AutoTokenizer.from_pretrained(directory)` reads them."""
        self._tokenizer.save_pretrained(str(directory))


def build_tokenizer(config: TokenizerConfig) -> ByteTokenizer | HFTokenizer:
    """The byte-level tokenizer when `config.path` is null, else the Hugging Face tokenizer in that directory."""
    if config.path is None:
        return ByteTokenizer()
    path = Path(config.path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"tokenizer.path={config.path!r} is not a directory; point it at a local Hugging Face tokenizer "
            "directory (with tokenizer.json / tokenizer_config.json), or set tokenizer.path=null for bytes."
        )
    return HFTokenizer(path)


# A tokenizer directory is often a whole model directory: hashing multi-GB weights would cost minutes per launch.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}


def _hash_directory(path: Path) -> str:
    """sha256 over the tokenizer's files (names and bytes), so any edit to the tokenizer changes the hash.

    Weights and hidden entries (download caches with timestamps) are skipped: they do not change the ids.
    """
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if not file.is_file() or file.suffix in _WEIGHT_SUFFIXES or any(p.startswith(".") for p in relative.parts):
            continue
        data = file.read_bytes()
        digest.update(f"{relative.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()
