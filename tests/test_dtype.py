"""``dtype``, as torch.softmax takes it: the output's dtype, x cast to it first. A 16-bit x to fp32 (the upcast of
attention code) is cast by the kernels as they load it, through every kernel family, and its gradient comes back in
x's dtype; other casts go through ``x.to(dtype)``."""

import pytest
import torch
from conftest import (
    BACKWARD_TOLERANCE,
    DTYPES,
    TOLERANCE,
    backward_tolerance,
    launched,
    randn,
    split_wherever_it_fits,
    torch_backward,
)
from torch.utils._python_dispatch import TorchDispatchMode

import helpers
from helpers import columns, ops, recipes, residency

HALVES = [torch.float16, torch.bfloat16]


class CastsSeen(TorchDispatchMode):
    """Counts the casts (``aten._to_copy``, or ``aten.to`` below autograd) torch runs in the block, inside the course's
    operators too: a call under a dispatch mode goes through its operator, whose body this runs under the mode."""

    casts = 0
    bodies = {torch.ops.softmax_course.softmax.default: ops._forward,
              torch.ops.softmax_course.softmax_backward.default: ops._backward}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to)
        if func in self.bodies:
            with self:
                return self.bodies[func](*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def check_upcast(x: torch.Tensor, dim: int, tolerance=TOLERANCE[torch.float32]) -> None:
    """softmax(x, dim, fp32) against torch's from the same 16-bit x, and the backward from fp32 y and dy into x's
    dtype, neither casting a tensor outside the kernels."""
    expected = torch.softmax(x, dim, dtype=torch.float32)
    with CastsSeen() as seen:
        y = helpers.softmax(x, dim, dtype=torch.float32)
    assert y.dtype == torch.float32 and y.stride() == expected.stride()
    torch.testing.assert_close(y, expected, equal_nan=True, **tolerance)
    dy = randn(*x.shape, scale=1.0)
    with seen:
        dx = helpers.softmax_backward(expected, dy, dim, dtype=x.dtype)
    assert seen.casts == 0
    assert dx.dtype == x.dtype and dx.stride() == expected.stride()
    # one rounding into x's dtype of what fp32 computes
    torch.testing.assert_close(dx, torch_backward(expected, dy, dim).to(x.dtype), equal_nan=True,
                               **backward_tolerance(expected, dy, dim, x.dtype))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("shape, dim", [((7, 33), -1), ((5, 1), -1), ((4, 21, 6, 5), 1), ((2, 37, 19), 1),
                                        ((9, 40), 0)])
def test_upcast_rows_and_held_columns(dtype, shape, dim):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[::7] = float("-inf")
    check_upcast(x, dim)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("two_pass", [False, True], ids=["split", "two-pass"])
@pytest.mark.parametrize("n_cols", [33, 100, 257])
def test_upcast_long_rows(monkeypatch, looped, dtype, two_pass, n_cols):
    """Rows split among programs (``looped``'s small pieces; odd lengths start off 16-byte boundaries, so the pieces'
    windows count in the input's 16 bytes), or taken in two passes where the split's programs would not fit."""
    if two_pass:
        monkeypatch.setattr(residency, "split_grid", lambda *args: 0)
    x = randn(7, n_cols, dtype=dtype)
    x[2, 5] = float("nan")
    check_upcast(x, -1)
    split = {"softmax_split_kernel", "softmax_backward_split_kernel"}
    passes = {"softmax_two_pass_kernel", "softmax_backward_two_pass_kernel"}
    assert launched() == (passes if two_pass else split)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("fits", [True, False], ids=["split", "two-pass"])
def test_upcast_long_columns(monkeypatch, dtype, fits):
    """A dim too long to hold, split among programs or taken in two passes (``test_columns.test_long_dims``'s
    pieces)."""
    monkeypatch.setattr(columns, "FORWARD_PIECE", (256, 64, 4))
    monkeypatch.setattr(columns, "BACKWARD_PIECE", (256, 64, 4))
    monkeypatch.setattr(recipes, "_recipes", {})
    split_wherever_it_fits(monkeypatch)
    if not fits:
        monkeypatch.setattr(residency, "split_grid", lambda *args: 0)
    x = randn(2, columns.MAX_HELD + 77, 24, dtype=dtype)
    x[0, :, 3] = float("-inf")
    assert columns.takes_columns(1, x)
    check_upcast(x, 1, dict(atol=1e-6, rtol=1e-4))  # the running sum, as test_columns' LONG_TOLERANCE
    kind = "split" if fits else "two_pass"
    assert launched() == {f"softmax_column_{kind}_kernel", f"softmax_backward_column_{kind}_kernel"}


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_upcast_autograd(dtype, dim):
    """The gradient of softmax(x, dim, fp32) reaches x in x's dtype, as torch's does; so under torch.compile."""
    x = randn(6, 5, 29, dtype=dtype).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    dy = randn(6, 5, 29, scale=1.0)
    y, y_torch = helpers.softmax(x, dim, torch.float32), torch.softmax(x_torch, dim, dtype=torch.float32)
    assert y.dtype == torch.float32
    (y * dy).sum().backward()
    (y_torch * dy).sum().backward()
    assert x.grad.dtype == dtype
    tolerance = backward_tolerance(y_torch.detach(), dy, dim, dtype, separate_y=True)
    torch.testing.assert_close(x.grad, x_torch.grad, **tolerance)
    compiled = torch.compile(lambda x: helpers.softmax(x, dim, dtype=torch.float32), backend="aot_eager",
                             fullgraph=True)
    x.grad = None
    (compiled(x) * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **tolerance)


@pytest.mark.parametrize("x_dtype, dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                            (torch.float32, torch.float64), (torch.bfloat16, torch.float64),
                                            (torch.float64, torch.float32), (torch.bfloat16, torch.float16)])
def test_other_casts_come_first(x_dtype, dtype):
    """Casts the kernels do not make as they load are torch's order: x cast to dtype (rounded, where it narrows),
    then its softmax; the gradient through the cast."""
    x = randn(5, 37, dtype=x_dtype).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    with CastsSeen() as seen:
        y = helpers.softmax(x, -1, dtype)
    expected = torch.softmax(x_torch, -1, dtype=dtype)
    assert y.dtype == dtype and seen.casts == 1
    torch.testing.assert_close(y, expected, **TOLERANCE[dtype])
    dy = randn(5, 37, dtype=dtype, scale=1.0)
    (y * dy).sum().backward()
    (expected * dy).sum().backward()
    assert x.grad.dtype == x_dtype
    narrower = max(x_dtype, dtype, key=lambda d: BACKWARD_TOLERANCE[d]["atol"])  # where the gradient was rounded
    torch.testing.assert_close(x.grad, x_torch.grad, **backward_tolerance(expected.detach(), dy, -1, narrower,
                                                                            separate_y=True))


def test_a_layout_remembers_each_dtype():
    """Plain calls of one layout with and without ``dtype`` each keep their own launch: repeats get the dtype they ask
    for."""
    x = randn(4, 50, dtype=torch.bfloat16)
    for _ in range(2):
        for dtype in (None, torch.float32, torch.bfloat16, torch.float64):
            y = helpers.softmax(x, -1, dtype)
            assert y.dtype == (dtype or x.dtype)
            torch.testing.assert_close(y, torch.softmax(x, -1, dtype=dtype), **TOLERANCE[y.dtype])
    y = torch.softmax(x.float(), -1)
    for _ in range(2):
        assert helpers.softmax_backward(y, y, -1).dtype == torch.float32
        assert helpers.softmax_backward(y, y, -1, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("y_dtype, dy_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.float64),
                                              (torch.float64, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("shape, dim", [((5, 37), -1), ((37, 5), 0), ((4, 21, 6, 5), 1)])
def test_backward_rounds_into_a_narrower_dtype(y_dtype, dy_dtype, dtype, shape, dim):
    """softmax_backward of mixed dtypes, computed in fp32 or (where y or dy is fp64) fp64, then rounded once into a
    16-bit ``dtype``, by rows, columns and turned tiles, on a layout's first call and a repeat (Triton's interpreter
    casts fp64 to bf16 as to an integer: the ops round that case on the host)."""
    y = torch.softmax(randn(*shape, dtype=torch.float64), dim).to(y_dtype)
    dy = randn(*shape, dtype=torch.float64, scale=1.0).to(dy_dtype)
    expected = torch_backward(y, dy, dim).to(dtype)
    for _ in range(2):
        dx = helpers.softmax_backward(y, dy, dim, dtype)
        assert dx.dtype == dtype
        torch.testing.assert_close(dx, expected, **backward_tolerance(y, dy, dim, dtype))


@pytest.mark.parametrize("x_dtype", [torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_integers_cast_to_a_float_dtype(x_dtype, dtype):
    """torch.softmax takes integer and bool tensors where ``dtype`` is a float dtype (x cast to it first): so do the
    ops; without ``dtype`` both refuse them (test_errors.py)."""
    x = (randn(5, 37) * 3).to(x_dtype)
    for _ in range(2):
        y = helpers.softmax(x, 0, dtype)
        assert y.dtype == dtype
        torch.testing.assert_close(y, torch.softmax(x, 0, dtype=dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32"])
def test_dtype_must_be_a_float_dtype(dtype):
    x = randn(3, 4)
    for call in (lambda: helpers.softmax(x, -1, dtype), lambda: helpers.softmax_backward(x, x, -1, dtype)):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            call()


def test_python_float_is_float64():
    """torch reads ``dtype=float`` as float64, as it does a tensor's ``.to(float)``."""
    x = randn(3, 4)
    for _ in range(2):  # the first call of the layout, then its kept launch
        y = helpers.softmax(x, -1, float)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, torch.softmax(x, -1, dtype=float))
        assert helpers.softmax_backward(y.float(), y.float(), -1, float).dtype == torch.float64


@pytest.mark.parametrize("autocast_dtype", HALVES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_gives_torchs_dtype(dtype, autocast_dtype):
    """Under autocast, the output's dtype is torch.softmax's: CUDA autocast's float32 list widens a 16-bit x to fp32,
    CPU autocast keeps x's dtype. So for a plain call of a layout launched before outside autocast, for autograd (the
    gradient in x's dtype) and under torch.compile."""
    x = randn(6, 5, 29, dtype=dtype)
    dy = randn(6, 5, 29, scale=1.0)
    helpers.softmax(x, -1)  # the layout's launch, kept for plain calls that ask for no dtype
    x_grad, x_torch = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(lambda x: helpers.softmax(x, 1), backend="aot_eager", fullgraph=True)
    with torch.autocast(helpers.DEVICE.type, dtype=autocast_dtype):
        expected, expected_dim_1 = torch.softmax(x_torch, -1), torch.softmax(x, 1)
        results = [helpers.softmax(x, -1), helpers.softmax(x, -1), helpers.softmax(x_grad, -1)]
        result_dim_1 = compiled(x)
    widened = helpers.DEVICE.type == "cuda" and dtype in HALVES
    assert expected.dtype == (torch.float32 if widened else dtype)  # what this test takes torch's rule to be
    for y in results:
        assert y.dtype == expected.dtype
        torch.testing.assert_close(y, expected, **TOLERANCE[y.dtype])
    assert result_dim_1.dtype == expected_dim_1.dtype
    torch.testing.assert_close(result_dim_1, expected_dim_1, **TOLERANCE[expected_dim_1.dtype])
    (results[-1] * dy).sum().backward()
    (expected * dy).sum().backward()
    assert x_grad.grad.dtype == dtype
    torch.testing.assert_close(x_grad.grad, x_torch.grad,
                               **backward_tolerance(expected.detach(), dy, -1, dtype, separate_y=True))
