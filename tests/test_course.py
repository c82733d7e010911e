"""The course's own consistency: notebooks, badges and README agree, and notebooks import helpers before triton."""

import json
import re
from pathlib import Path

import pytest

from helpers.notebooks import colab_badge

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cells(path):
    return json.loads(path.read_text())["cells"]


def test_there_are_notebooks():
    assert NOTEBOOKS and all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", p.name) for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_has_title_and_badge(path):
    first = "".join(cells(path)[0]["source"])
    assert first.startswith("# ") and colab_badge(path.name) in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_readme_links_notebook_with_badge(path):
    readme = (ROOT / "README.md").read_text()
    assert f"(notebooks/{path.name})" in readme and colab_badge(path.name) in readme


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_helpers_imported_before_triton(path):
    code = "\n".join("".join(c["source"]) for c in cells(path) if c["cell_type"] == "code")
    assert "import helpers" in code
    triton_at = code.find("import triton")
    assert triton_at == -1 or code.find("import helpers") < triton_at


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_are_from_a_clean_run(path):
    code_cells = [c for c in cells(path) if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code_cells]
    assert counts == list(range(1, len(code_cells) + 1)), "re-run with `make notebooks`"
    for c in code_cells:
        for out in c["outputs"]:
            assert out["output_type"] != "error"
            assert out.get("name") != "stderr", f"stderr in committed output: {''.join(out['text'])[:200]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_lines_fit_120_columns(path):
    """Prose wraps at 120 characters, as ruff holds the code cells to (the Colab badge's link cannot wrap)."""
    badge = colab_badge(path.name)
    long_lines = [(index, line[:50]) for index, cell in enumerate(cells(path)) if cell["cell_type"] == "markdown"
                  for line in "".join(cell["source"]).splitlines() if len(line) > 120 and badge not in line]
    assert not long_lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_inline_formulas_stay_on_one_line(path):
    """An inline formula ($...$) opens and closes on one line, so that no renderer has to join one across a line
    break (the notebooks are read in JupyterLab, on Colab and on GitHub, whose Markdown parsers differ). Display
    formulas ($$) may take several lines."""
    broken = [(index, line[-50:]) for index, cell in enumerate(cells(path)) if cell["cell_type"] == "markdown"
              for line in "".join(cell["source"]).splitlines()
              if re.sub(r"`[^`]*`", "", line).replace("$$", "").count("$") % 2]
    assert not broken
