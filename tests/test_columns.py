"""Softmax over a dim that is not the last, in place (helpers.columns): which calls take it, torch's values and
layout, and the plan's limits."""

import pytest
import torch
from conftest import BACKWARD_TOLERANCE, DTYPES, TOLERANCE, randn, torch_backward

import helpers
from helpers import columns

# (shape, dim): a short class dim, a dim of 1, an odd dim over odd columns, the longest dim held, a leading dim
# the walk's running sum rounds once per chunk of LOOPED_ROWS: fp32 a little looser than TOLERANCE
LONG_TOLERANCE = {**TOLERANCE, torch.float32: dict(atol=1e-6, rtol=1e-4)}
SHAPES = [((4, 21, 6, 5), 1), ((3, 1, 7), 1), ((2, 37, 19), 1), ((2, columns.MAX_REDUCED, 3), 1), ((9, 40), 0)]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float64])
@pytest.mark.parametrize("shape, dim", SHAPES)
def test_values_and_layout(shape, dim, dtype):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[::7] = float("-inf")  # columns with -inf, and (for dims of 1) columns of nothing but -inf
    assert columns.takes_columns(dim, x)
    y, expected = helpers.softmax_forward(x, dim), torch.softmax(x, dim)
    torch.testing.assert_close(y, expected, equal_nan=True, **TOLERANCE[dtype])
    assert y.stride() == expected.stride() == x.stride()  # torch's layout: contiguous, as the input
    dy = randn(*shape, dtype=dtype, scale=1.0)
    dx = helpers.softmax_backward(expected, dy, dim)
    torch.testing.assert_close(dx.double(), torch_backward(expected, dy, dim), equal_nan=True,
                               **BACKWARD_TOLERANCE[dtype])
    assert dx.stride() == x.stride()


def test_autograd_gradient_in_the_input_layout():
    x = randn(3, 21, 8).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    weights = torch.linspace(-1, 1, 8, device=x.device)  # dy of order 1, as BACKWARD_TOLERANCE assumes
    (helpers.softmax(x, 1) * weights).sum().backward()
    (torch.softmax(x_torch, 1) * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **BACKWARD_TOLERANCE[torch.float32])
    assert x.grad.stride() == x_torch.grad.stride()


@pytest.mark.parametrize("make_input, dim", [
    (lambda: randn(2, columns.MAX_REDUCED + 1, 3), 1),  # too long to hold, too few columns to walk it
    (lambda: randn(6, 5, 4).transpose(0, 2), 1),  # not contiguous
    (lambda: randn(5, 7, dtype=torch.float64), 0),  # fp64
    (lambda: randn(5, 7), 1),  # the last dim: rows
    (lambda: randn(5, 7, 1), 1),  # no neighbours: contiguous rows
])
def test_other_calls_keep_the_rows_path(make_input, dim):
    x = make_input()
    assert not columns.takes_columns(dim, x)
    torch.testing.assert_close(helpers.softmax_forward(x, dim), torch.softmax(x, dim), **TOLERANCE[x.dtype])


@pytest.mark.parametrize("n_reduced", [1, 21, 100, 512, columns.MAX_REDUCED])
@pytest.mark.parametrize("n_inner", [1, 3, 4096, 262144])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("n_inputs", [1, 2])
def test_plan(n_reduced, n_inner, element_size, n_inputs):
    plan = columns.column_plan(n_reduced, n_inner, element_size, n_inputs)
    assert plan.block_r >= n_reduced and plan.block_r & (plan.block_r - 1) == 0  # the whole dim, a power of two
    run_bytes = columns.NARROW_RUN_BYTES if n_reduced > columns.LONG_COLUMN // 2 else columns.WIDE_RUN_BYTES
    assert plan.block_c == columns.MIN_COLUMNS or plan.block_c * element_size <= run_bytes
    assert plan.block_c <= max(columns.MIN_COLUMNS, n_inner * 2)  # no wider than the columns there are
    held_bytes = plan.block_r * plan.block_c * element_size * n_inputs
    assert plan.num_warps in (2, 4, 8, 16) and plan.num_warps * columns.WARP_BYTES <= max(2 * columns.WARP_BYTES,
                                                                                          held_bytes)
    assert columns.column_plan(columns.MAX_REDUCED + 1, n_inner, element_size).looped


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_long_dims_are_walked(monkeypatch, dtype):
    monkeypatch.setattr(columns, "LOOPED_MIN_PROGRAMS", 1)  # small enough for the interpreter
    x = randn(2, columns.MAX_REDUCED + 77, 40, dtype=dtype)
    x[0, :, 3] = float("-inf")  # a column of nothing but -inf
    x[1, 5, 7] = float("nan")
    assert columns.takes_columns(1, x)
    y, expected = helpers.softmax_forward(x, 1), torch.softmax(x, 1)
    torch.testing.assert_close(y, expected, equal_nan=True, **LONG_TOLERANCE[dtype])
    assert y.stride() == x.stride()
    dy = randn(*x.shape, dtype=dtype, scale=1.0)
    dx = helpers.softmax_backward(expected, dy, 1)
    torch.testing.assert_close(dx.double(), torch_backward(expected, dy, 1), equal_nan=True,
                               **BACKWARD_TOLERANCE[dtype])
    assert dx.stride() == x.stride()
