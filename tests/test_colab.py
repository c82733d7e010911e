"""Every notebook's first code cell, run as Colab would run it: it clones the course and makes helpers importable,
installs nothing (Colab's torch and triton stay), and does nothing at all off Colab."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers.notebooks import COLAB_CHECKOUT, REPOSITORY, colab_setup_cell

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def first_code_cell(path):
    return next("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


@pytest.fixture
def recorded_commands(monkeypatch):
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: commands.append(command))
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    return commands


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_on_colab(path, recorded_commands, monkeypatch):
    assert first_code_cell(path) == colab_setup_cell()
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    exec(first_code_cell(path), {})
    assert recorded_commands == [["git", "clone", "--quiet", "--depth=1", f"https://github.com/{REPOSITORY}",
                                  COLAB_CHECKOUT]]
    assert sys.path[0] == COLAB_CHECKOUT
    assert "pip" not in first_code_cell(path)  # nothing installed: Colab's torch and triton are kept


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_elsewhere_does_nothing(path, recorded_commands, monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    before = list(sys.path)
    exec(first_code_cell(path), {})
    assert recorded_commands == [] and sys.path == before
