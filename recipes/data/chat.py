"""Conversations for supervised fine-tuning: where they come from, what a valid one is, and the built-in ones.

A conversation is a list of messages `{"role": ..., "content": ...}` with at least one assistant turn. Sources:
`chat` (rows of local .jsonl/.json/.parquet files, a local dataset directory or a hub dataset, with a
`data.messages_field` column) and
`synthetic` (built-in conversations with learnable answers, for offline smoke runs).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from recipes.data.sources import load_rows
from recipes.schema import DataConfig

SYNTHETIC_CHAT_VERSION = 1

Conversation = list[dict[str, str]]


def iter_conversations(config: DataConfig) -> Iterator[Conversation]:
    """Every conversation of the source, in a fixed order; one that is not a valid conversation is refused with the
    row it came from."""
    if config.source == "synthetic":
        yield from synthetic_conversations(seed=0, num_bytes=config.synthetic_num_bytes)
        return
    where = f"data.paths={list(config.paths)}" if config.paths else f"data.name={config.name!r}"
    for number, row in enumerate(load_rows(config), start=1):
        if config.messages_field not in row:
            raise ValueError(
                f"{where}: row {number} has no {config.messages_field!r} column (it has "
                f"{', '.join(map(repr, row))}); set data.messages_field to the column holding the messages"
            )
        yield check_conversation(row[config.messages_field], where=f"{where}, row {number}")


def check_conversation(messages: object, *, where: str) -> Conversation:
    """`messages` as a conversation, or a ValueError saying what is wrong with it and where it is."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: the messages are not a non-empty list of {{'role': ..., 'content': ...}}")
    for turn, message in enumerate(messages, start=1):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: message {turn} is not {{'role': <text>, 'content': <text>}}: {message!r:.200}")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError(
            f"{where}: the conversation has no assistant turn with content, so nothing in it would be trained on; "
            "drop it or add the assistant's answer"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def synthetic_conversations(*, seed: int, num_bytes: int) -> Iterator[Conversation]:
    """Deterministic conversations whose answers follow from the question (sums, reversed words, counted letters),
    about `num_bytes` of content in all: a model that learns them shows a falling loss on the assistant's tokens."""
    rng = random.Random(f"ckptless-synthetic-chat-v{SYNTHETIC_CHAT_VERSION}-{seed}")
    words = ["river", "stone", "lantern", "orbit", "meadow", "copper", "signal", "harbor", "violet", "engine"]
    produced = 0
    while produced < num_bytes:
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == 1:
            word = rng.choice(words)
            question, answer = f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
        else:
            word, letter = rng.choice(words), rng.choice("aeiourn")
            question, answer = (
                f"How many times does {letter} occur in {word}?",
                f"{letter} occurs {word.count(letter)} times in {word}.",
            )
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.25:
            conversation.insert(0, {"role": "system", "content": "Answer in one sentence."})
        produced += sum(len(m["content"]) for m in conversation)
        yield conversation
