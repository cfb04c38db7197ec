"""What every benchmark script shares: where the repository is, the environment its runs get, the provenance line
of its results, and how it writes them (JSON with every raw number, Markdown with the table, printed too)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def provenance() -> dict:
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": version("torch"),
    }


def write_report(out: Path, name: str, result: dict, lines: list[str]) -> None:
    """`out/<name>.json` (the result) and `out/<name>.md` (a title from its provenance, then `lines`), printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = [f"# {name} ({result['when']}, {result['machine']}, torch {result['torch']})", "", *lines]
    (out / f"{name}.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
