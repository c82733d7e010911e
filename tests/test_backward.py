"""helpers.softmax_backward and the autograd wrapper against torch: strides, zero-stride grads, gradcheck."""

import pytest
import torch
from conftest import (
    AUTOGRAD_SOFTMAXES,
    BACKWARD_TOLERANCE,
    DTYPES,
    LAYOUT_PATHS,
    ODD_SHAPE,
    assert_path,
    backward_tolerance,
    layout_inputs,
    randn,
    torch_backward,
)

import helpers


def check_backward(y, dy, dim=-1):
    y_before, dy_before = y.clone(), dy.clone()
    dx = helpers.softmax_backward(y, dy, dim)
    assert dx.shape == y.shape and dx.dtype == y.dtype and dx.is_contiguous()  # torch's layout
    assert dx._base is None  # a tensor of its own, as torch's (not a view)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, dim), equal_nan=True,
                               **backward_tolerance(y, dy, dim))
    assert torch.equal(y, y_before) and torch.equal(dy, dy_before)  # inputs are never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_shape(dtype):
    y = torch.softmax(randn(*ODD_SHAPE, dtype=torch.float64), -1).to(dtype)
    check_backward(y, randn(*ODD_SHAPE, dtype=dtype, scale=1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [1, 15, 17, 100])
def test_rows_split_into_small_pieces(looped, dtype, n_cols):
    """Under ``looped`` a row past 16 elements is split into pieces of 16-64, so odd lengths span several."""
    y = torch.softmax(randn(6, n_cols, dtype=torch.float64), -1).to(dtype)
    check_backward(y, randn(6, n_cols, dtype=dtype, scale=1.0))


def test_long_rows():
    n_cols = helpers.plans.ALWAYS_TILE_ROW + 77  # at the plans' own sizes: split among programs
    assert helpers.plans.plan_for(n_cols, "backward", 4).segments > 1
    y = torch.softmax(randn(3, n_cols), -1)
    check_backward(y, randn(3, n_cols, scale=1.0))


@pytest.mark.parametrize("shape, dim", [((5, 7, 9), 0), ((5, 7, 9), 1), ((2, 3, 4, 5), -2), ((), 0),
                                        ((5, 1), 0), ((3, 5, 1), 1), ((3, 1, 4), 1)])
def test_any_rank_and_dim(shape, dim):
    y = torch.softmax(randn(*shape), dim)
    check_backward(y, randn(*shape, scale=1.0), dim)


@pytest.mark.parametrize("make_dy", [
    pytest.param(lambda shape: torch.ones((), device=helpers.DEVICE).expand(shape), id="all-zero-strides"),
    pytest.param(lambda shape: randn(shape[0], 1).expand(shape), id="zero-column-stride"),
    pytest.param(lambda shape: randn(1, shape[1]).expand(shape), id="zero-row-stride"),
    pytest.param(lambda shape: randn(shape[1], shape[0]).t(), id="transposed"),
    pytest.param(lambda shape: randn(shape[0], 2 * shape[1])[:, ::2], id="sliced"),
])
def test_strided_grad_outputs(make_dy):
    # rows of y summing to 0.2-2.0 rather than 1, so that a gradient constant along a row still gives a nonzero dx
    y = torch.softmax(randn(9, 23), -1) * torch.linspace(0.2, 2.0, 9, device=helpers.DEVICE)[:, None]
    check_backward(y, make_dy(y.shape))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.enable_grad])
@pytest.mark.parametrize("dim", [0, -1])
def test_inference_mode_records_nothing(grad_mode, dim):
    """Under ``torch.inference_mode`` autograd records nothing, even inside ``enable_grad`` and for inputs that require
    grad: softmax and softmax_backward return inference tensors without a grad_fn, as torch's (an autograd.Function
    would record them, and fail to save its output), on a layout's first call and a repeat."""
    x, dy = randn(7, 37).requires_grad_(), randn(7, 37, scale=1.0).requires_grad_()
    y = torch.softmax(x.detach(), dim)
    for _ in range(2):
        with torch.inference_mode(), grad_mode():
            pairs = [(helpers.softmax(x, dim), torch.softmax(x, dim)),
                     (helpers.softmax_backward(y, dy, dim), torch._softmax_backward_data(dy, y, dim, y.dtype))]
        for got, expected in pairs:
            assert (got.is_inference(), got.requires_grad, got.grad_fn) == (True, False, None)
            assert (expected.is_inference(), expected.requires_grad, expected.grad_fn) == (True, False, None)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_autograd_matches_torch(softmax, dtype, dim):
    x = randn(6, 5, 29, dtype=dtype).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    dy = randn(6, 5, 29, dtype=dtype, scale=1.0)
    y = softmax(x, dim)
    y_torch = torch.softmax(x_torch, dim)
    (y * dy).sum().backward()
    (y_torch * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **backward_tolerance(y_torch.detach(), dy, dim, separate_y=True))


def test_sum_backward_passes_zero_stride_grads():
    """y.sum().backward() hands the backward an expanded tensor of ones; the gradient of a sum of softmaxes is 0. A
    weighted sum of y's columns hands it one expanded along dim 1 that varies down dim 0, the softmax dim."""
    x = randn(8, 33).requires_grad_()
    helpers.softmax(x, 0).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-6, rtol=0)
    weights = randn(8)
    x.grad = None
    x_torch = x.detach().clone().requires_grad_()
    (helpers.softmax(x, 0).sum(1) * weights).sum().backward()
    (torch.softmax(x_torch, 0).sum(1) * weights).sum().backward()
    assert x.grad.abs().max() > 0.1
    torch.testing.assert_close(x.grad, x_torch.grad)


def test_indexing_passes_strided_grads():
    x = randn(8, 33).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    helpers.softmax(x)[::2, 3:].sum().backward()
    torch.softmax(x_torch, -1)[::2, 3:].sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad)


@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
@pytest.mark.parametrize("shape, dim", [((4, 9), -1), ((4, 9), 0), ((3, 2, 5), 1)])
def test_gradcheck(softmax, shape, dim):
    x = randn(*shape, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softmax(t, dim), (x,))


def test_gradcheck_looped(looped):
    x = randn(2, 21, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(helpers.softmax, (x,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, dim", [(ODD_SHAPE, -1), ((5, 7, 9), 1), ((4, 1), -1)])
def test_graph_backward_matches_torch(dtype, shape, dim):
    x = randn(*shape, dtype=dtype).requires_grad_()
    x_torch = x.detach().clone().requires_grad_()
    dy = randn(*shape, dtype=dtype, scale=1.0)
    (helpers.graph_softmax(x, dim) * dy).sum().backward()
    y_torch = torch.softmax(x_torch, dim)
    (y_torch * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_torch.grad, **backward_tolerance(y_torch.detach(), dy, dim, separate_y=True))


def test_graph_backward_with_ties_and_gradcheck():
    x = torch.tensor([[2.0, 2.0, 1.0, -1.0]], dtype=torch.float64, device=helpers.DEVICE).requires_grad_()
    dy = torch.tensor([[0.3, -0.2, 0.5, 0.1]], dtype=torch.float64, device=helpers.DEVICE)
    (helpers.graph_softmax(x) * dy).sum().backward()
    torch.testing.assert_close(x.grad, torch_backward(torch.softmax(x.detach(), -1), dy, -1))
    x = randn(3, 11, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(helpers.graph_softmax, (x,))


def test_graph_backward_refuses_a_second_order():
    """A gradient of its gradient would need the graph kernel's own backward: an error, not a gradient short of a
    part."""
    x = randn(3, 11, dtype=torch.float64, scale=1.0).requires_grad_()
    with pytest.raises(RuntimeError, match="graph_softmax's backward is not differentiable"):
        torch.autograd.grad(helpers.graph_softmax(x)[:, 0].sum(), x, create_graph=True)


def test_graph_backward_refuses_long_rows(looped):
    x = randn(2, 40).requires_grad_()
    with pytest.raises(ValueError, match="whole row in one block"):
        helpers.graph_softmax(x).sum().backward()


def gradient_penalty_grads(softmax, x, w, dim):
    """The gradients for ``x`` and ``w`` of a penalty on the gradient of ``<softmax(x), w>``: the first backward is
    differentiated again (``create_graph``)."""
    (grad_x,) = torch.autograd.grad((softmax(x, dim) * w).sum(), x, create_graph=True)
    return torch.autograd.grad(grad_x.pow(2).sum(), (x, w))


@pytest.mark.parametrize("path", LAYOUT_PATHS)
@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
def test_double_backward_matches_torch(softmax, path):
    """A gradient penalty through every path, against torch in fp64. Differentiating the backward again needs the
    gradient through the saved output y too, not only through dy (which ``once_differentiable`` looked at: it lost
    the part through y)."""
    x, w, dim = layout_inputs(path, 2)
    y = helpers.softmax(x, dim)
    assert_path(path, dim, x)  # the forward
    assert_path(path, dim, y, w)  # both backwards: of dy = w, then of g, laid out as w
    ours = [t.clone().requires_grad_() for t in (x, w)]
    theirs = [t.double().requires_grad_() for t in (x, w)]
    expected = gradient_penalty_grads(torch.softmax, *theirs, dim)
    for got, want in zip(gradient_penalty_grads(softmax, *ours, dim), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())  # to its scale


@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32)], ids=["bf16", "bf16-to-fp32", "fp32"])
def test_double_backward_in_lower_precision(dtype, out_dtype):
    """The second-order gradients' dtypes, in the input's dtype and for a 16-bit input asked for an fp32 output (the
    backward's y fp32, dy and dx bf16), and their values to 16-bit rounding. That rounding would hide a wrong term:
    the formula is checked in fp32 and fp64 above."""
    x, w = randn(6, 33, dtype=dtype, scale=1.0), randn(6, 33, dtype=out_dtype, scale=1.0)
    ours, theirs = ([t.clone().requires_grad_() for t in (x, w)] for _ in range(2))
    got = gradient_penalty_grads(lambda t, dim: helpers.softmax(t, dim, out_dtype), *ours, -1)
    want = gradient_penalty_grads(lambda t, dim: torch.softmax(t, dim, dtype=out_dtype), *theirs, -1)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **BACKWARD_TOLERANCE[dtype])


@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
@pytest.mark.parametrize("shape, dim", [((4, 9), -1), ((4, 9), 0), ((2, 5, 3), 1)])
def test_gradgradcheck(softmax, shape, dim):
    x = randn(*shape, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: softmax(t, dim), (x,))


def test_backward_is_differentiable():
    """``softmax_backward`` itself, in both its inputs, to the third order."""
    y = torch.softmax(randn(3, 7, dtype=torch.float64, scale=1.0), -1).requires_grad_()
    dy = randn(3, 7, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradgradcheck(helpers.softmax_backward, (y, dy))
