"""The built-in synthetic corpus: English-like lines with structure a tiny byte-level model learns in minutes.

Most of each line is predictable from what came before it (fixed facts about animals, counting, sums, the order of
days), so the loss of a small model falls well below that of random bytes within a few hundred steps; the rest is
free choice from small word lists, so the model cannot just memorise one string. Offline smoke runs train on it.
"""

from __future__ import annotations

import random

# Bump when the output for a given (seed, num_bytes) changes: token-file cache keys include it.
SYNTHETIC_VERSION = "synthetic-v1"

# The fixed "world": every animal has one colour, one food and one home, the same for every seed.
_ANIMALS = {
    "fox": ("red", "apples", "forest"),
    "cat": ("black", "fish", "house"),
    "dog": ("brown", "bones", "yard"),
    "owl": ("grey", "mice", "tree"),
    "bear": ("big", "honey", "cave"),
    "frog": ("green", "flies", "pond"),
    "goat": ("white", "grass", "hill"),
    "duck": ("yellow", "bread", "lake"),
    "wolf": ("silver", "meat", "woods"),
    "horse": ("tall", "hay", "barn"),
}
_NAMES = ["anna", "ben", "clara", "david", "emma", "felix", "grace", "henry"]
_VERBS = ["sees", "likes", "finds", "draws", "follows", "hears"]
_ADJECTIVES = ["small", "happy", "quiet", "old", "fast", "young"]
_DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _fact_line(rng: random.Random) -> str:
    animal = rng.choice(list(_ANIMALS))
    color, food, home = _ANIMALS[animal]
    kind = rng.randrange(3)
    if kind == 0:
        return f"the {color} {animal} eats {food}."
    if kind == 1:
        return f"the {animal} lives in the {home}."
    return f"where does the {animal} live? in the {home}."


def _counting_line(rng: random.Random) -> str:
    start = rng.randrange(0, 90)
    return "count: " + " ".join(str(n) for n in range(start, start + rng.randrange(4, 10))) + "."


def _sum_line(rng: random.Random) -> str:
    a, b = rng.randrange(6), rng.randrange(5)
    return f"{_NUMBER_WORDS[a]} plus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a + b]}."


def _day_line(rng: random.Random) -> str:
    day = rng.randrange(7)
    return f"after {_DAYS[day]} comes {_DAYS[(day + 1) % 7]}."


def _alphabet_line(rng: random.Random) -> str:
    start = rng.randrange(0, 20)
    return " ".join(_LETTERS[start : start + rng.randrange(4, 7)]) + "."


def _story_line(rng: random.Random) -> str:
    animal = rng.choice(list(_ANIMALS))
    return f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {animal}."


_LINE_MAKERS = [_fact_line, _fact_line, _counting_line, _sum_line, _day_line, _alphabet_line, _story_line]


def synthetic_text(*, seed: int, num_bytes: int) -> str:
    """`num_bytes` of ASCII text (lines joined by "\\n"), a pure function of `seed` and `num_bytes`.

    The last line is cut at `num_bytes`, so the size is exact.
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes={num_bytes} must be >= 0")
    rng = random.Random(seed)
    lines: list[str] = []
    size = -1  # n lines joined take n - 1 separators
    while size < num_bytes:
        line = rng.choice(_LINE_MAKERS)(rng)
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:num_bytes]
