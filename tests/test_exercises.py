"""Notebook 09: every checker fails on the untouched stub and on a plausible wrong answer, passes on the reference
solution, and the notebook run with the solutions in place of its stubs passes every check."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import exercises, solutions
from helpers.display import source_of

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "09_exercises.ipynb"
CHECKS = {name: getattr(exercises, f"check_{name}") for name in solutions.SOLUTIONS}
# what the notebook's setup cell provides to the stubs
PRELUDE = "import torch\nimport triton\nimport triton.language as tl\nfrom helpers import softmax_forward\n\n"

WRONG = {  # a plausible mistake for each exercise
    "column_softmax": lambda x: torch.softmax(x, dim=-1),  # along rows instead of columns
    "temperature_softmax": lambda x, t: torch.softmax(x * t, dim=-1),  # multiplies by T
    "log_softmax": lambda x: torch.log(torch.softmax(x, dim=-1)),  # underflows to -inf
    "scaled_softmax": lambda x, s: torch.softmax(x, dim=-1) * s,  # scales the output, not the input
    "predicted_plans": {name: (1, 1) for name in exercises.SHAPES},  # "one row per program" everywhere
    "causal_softmax": lambda x: torch.softmax(x.tril(), dim=-1),  # zeros instead of -inf: the future keeps weight
}


def stub_sources():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    stubs = {}
    for cell in cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith("exercise:"):
                stubs[tag.removeprefix("exercise:")] = "".join(cell["source"])
    return stubs


def test_every_exercise_has_a_stub_a_check_and_a_solution():
    assert set(stub_sources()) == set(CHECKS) == set(WRONG)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_checker_fails_on_the_untouched_stub(name, tmp_path, capsys):
    # a module file, not exec: @triton.jit reads its function's source from the file
    path = tmp_path / f"stub_{name}.py"
    path.write_text(PRELUDE + stub_sources()[name])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert CHECKS[name](getattr(module, name)) is False
    assert capsys.readouterr().out.startswith(exercises.FAIL)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_checker_fails_on_a_wrong_answer(name, capsys):
    assert CHECKS[name](WRONG[name]) is False
    out = capsys.readouterr().out
    assert out.startswith(exercises.FAIL) and ("differ" in out or "predicted" in out)


def _unsafe_softmax(x, dim=-1):
    """softmax without subtracting the max: right for small values, inf / inf = NaN once exp overflows."""
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


SUBTLER_WRONG = {  # mistakes the first inputs alone would let through
    "column_softmax: no max subtracted": ("column_softmax", lambda x: _unsafe_softmax(x, 0)),
    "column_softmax: reads x as if contiguous": (  # ignores the column stride: wrong on a transposed x
        "column_softmax", lambda x: torch.softmax(torch.as_strided(x, x.shape, (x.shape[1], 1)), dim=0)),
    "scaled_softmax: no max subtracted": ("scaled_softmax", lambda x, s: _unsafe_softmax(x * s)),
    "causal_softmax: no max subtracted": (
        "causal_softmax", lambda x: _unsafe_softmax(x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1),
                                                                  float("-inf")))),
}


def test_an_output_left_unwritten_is_nan_to_the_checker(capsys):
    """A causal kernel that stores only the visible columns leaves the masked ones as the memory was, often 0, the
    value they should hold; in the checker every new tensor starts as NaN, so the mistake fails whatever the memory
    held. The setting is PyTorch's own, restored afterwards."""
    starts = []

    def visible_columns_only(x):
        y = torch.empty_like(x)
        starts.append(bool(y.isnan().all()))
        visible = torch.ones_like(x, dtype=torch.bool).tril()
        y[visible] = torch.softmax(x.masked_fill(~visible, float("-inf")), dim=-1)[visible]
        return y

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    assert exercises.check_causal_softmax(visible_columns_only) is False
    assert starts == [True] and "got nan, expected 0" in capsys.readouterr().out
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before


def test_a_function_that_writes_its_input_cannot_change_the_expected_values(capsys):
    """Scaling x in place before a plain softmax kernel: the values come out right on the checker's own inputs, and
    the check names the arithmetic outside the kernel, not a difference."""
    assert exercises.check_scaled_softmax(lambda x, s: solutions.scaled_softmax(x.mul_(s), 1.0)) is False
    out = capsys.readouterr().out
    assert "differ" not in out and "outside the kernel (mul)" in out


def test_scaled_softmax_scaled_before_its_kernel_fails(capsys):
    """The right values from a scale applied in PyTorch and a plain softmax kernel: not fused, and the check says so
    (the solution's own kernel run with scale 1 on a scaled x)."""
    assert exercises.check_scaled_softmax(lambda x, s: solutions.scaled_softmax(x * s, 1.0)) is False
    assert capsys.readouterr().out.startswith(f"{exercises.FAIL} scaled_softmax: PyTorch computes on the scores "
                                              f"outside the kernel (mul)")


@pytest.mark.parametrize("scale_first", [lambda x, s: torch.multiply(x, s), lambda x, s: x.divide(1 / s),
                                         lambda x, s: torch.true_divide(x, 1 / s)],
                         ids=["torch.multiply", "Tensor.divide", "torch.true_divide"])
def test_scaled_softmax_scaled_by_an_alias_before_its_kernel_fails(scale_first, capsys):
    """torch's other names for multiply and divide are arithmetic outside the kernel too."""
    assert exercises.check_scaled_softmax(lambda x, s: solutions.scaled_softmax(scale_first(x, s), 1.0)) is False
    assert "outside the kernel (" in capsys.readouterr().out


def test_column_softmax_wrong_in_its_smallest_outputs_fails(capsys):
    """Many outputs of a long column are under 1e-5: doubling just those fails the check."""
    def doubled_where_small(x):
        y = torch.softmax(x, dim=0)
        return torch.where(y < 1e-5, 2 * y, y)
    assert exercises.check_column_softmax(doubled_where_small) is False
    assert "values differ" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", sorted(SUBTLER_WRONG))
def test_checker_fails_on_a_subtler_mistake(mistake, capsys):
    name, wrong = SUBTLER_WRONG[mistake]
    assert CHECKS[name](wrong) is False
    assert "differ" in capsys.readouterr().out


def test_predicted_plans_as_lists_pass():
    as_lists = {name: list(plan) for name, plan in solutions.predicted_plans.items()}
    assert exercises.check_predicted_plans(as_lists) is True


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_checker_passes_on_the_solution(name, capsys):
    assert CHECKS[name](getattr(solutions, name)) is True
    assert exercises.FAIL not in capsys.readouterr().out


def solution_source(name):
    parts = []
    for item in solutions.SOLUTIONS[name]:
        parts.append(f"{item} = {getattr(solutions, item)!r}\n" if isinstance(item, str) else source_of(item))
    return "\n\n".join(parts)


def test_notebook_with_solutions_passes_every_check():
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t.startswith("exercise:")]
        if tags:
            cell.source = solution_source(tags[0].removeprefix("exercise:"))
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    printed = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for out in cell.outputs)
    assert exercises.FAIL not in printed
    passes = [line for line in printed.splitlines() if line.startswith(exercises.PASS)]
    assert {line.split(":")[0].removeprefix(exercises.PASS + " ") for line in passes} >= {
        "column_softmax", "temperature_softmax", "log_softmax", "scaled_softmax", "causal_softmax",
        "the course's softmax on every shape"}
