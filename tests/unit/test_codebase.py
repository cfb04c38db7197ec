"""Rules a newcomer finds the code by, kept as it grows: every module of the packages says what it owns in its
docstring and stays under 500 lines (one past about 400 is usually two ideas: split it along its docstring's seams),
and `ckptless_core` works without Hydra, OmegaConf, transformers or the layers above it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ckptless_core

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("ckptless_core", "launcher", "recipes")
MODULES = sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_has_a_docstring_and_at_most_500_lines(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{path.name} is past 500 lines: split it along the seams it describes"
    if path.name != "__main__.py":
        assert ast.get_docstring(ast.parse(text)), f"{path.name} does not say what it owns"


def test_core_imports_neither_hydra_omegaconf_transformers_nor_upper_layers():
    modules = sorted(f"ckptless_core.{p.stem}" for p in Path(ckptless_core.__file__).parent.glob("*.py"))
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "top = {name.split('.')[0] for name in sys.modules}\n"
        "print(json.dumps(sorted(top & {'hydra', 'omegaconf', 'transformers', 'launcher', 'recipes'})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
