"""Forward-mode AD and torch.func's transforms (grad, vjp, jvp, vmap, jacrev, jacfwd, hessian) through helpers.softmax
and helpers.softmax_backward, against torch.softmax."""

import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import (
    AUTOGRAD_SOFTMAXES,
    BACKWARD_TOLERANCE,
    LAYOUT_PATHS,
    assert_path,
    layout_inputs,
    randn,
    torch_backward,
)

import helpers


def dual_softmax(softmax, x, tangent, dim, dtype=None):
    """``softmax(x, dim, dtype)`` and its tangent for ``x``'s ``tangent``, by forward-mode AD."""
    with fwAD.dual_level():
        primal, result = fwAD.unpack_dual(softmax(fwAD.make_dual(x, tangent), dim, dtype))
    return primal, result


@pytest.mark.parametrize("path", LAYOUT_PATHS)
@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
def test_forward_mode_matches_torch(softmax, path):
    """The tangent through every path, against torch in fp64. A plain call of the same layout comes first: its
    kept launch (``ops._plain_calls``) must not take the dual call, which would drop the tangent."""
    x, tangent, dim = layout_inputs(path, 2)
    y = helpers.softmax(x, dim)
    assert_path(path, dim, x)  # the forward
    assert_path(path, dim, y, tangent)  # the tangent: the backward's formula, of the tangent
    y_dual, y_tangent = dual_softmax(softmax, x, tangent, dim)
    want_y, want_tangent = dual_softmax(torch.softmax, x.double(), tangent.double(), dim)
    assert y_tangent is not None and y_tangent.dtype == y.dtype and y_tangent.shape == y.shape
    torch.testing.assert_close(y_dual, y)
    torch.testing.assert_close(y_tangent.double(), want_tangent, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype, out_dtype, tangent_dtype", [
    (torch.bfloat16, None, None), (torch.bfloat16, torch.float32, None), (torch.float16, None, None),
    (torch.float32, torch.float64, None), (torch.float64, None, None), (torch.bfloat16, None, torch.float32),
    (torch.float32, None, torch.float64)])
def test_forward_mode_dtypes(dtype, out_dtype, tangent_dtype):
    """The tangent's dtype is torch's: the output's, for a 16-bit input asked for fp32 and an upcast to fp64, or the
    tangent's where it is wider."""
    x, tangent = randn(5, 33, dtype=dtype), randn(5, 33, dtype=tangent_dtype or dtype, scale=1.0)
    _, got = dual_softmax(helpers.softmax, x, tangent, -1, out_dtype)
    _, want = dual_softmax(torch.softmax, x, tangent, -1, out_dtype)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **BACKWARD_TOLERANCE[out_dtype or dtype])  # to y's rounding


def test_forward_mode_of_the_backward():
    """Tangents of ``y`` and of ``dy`` through ``softmax_backward``, each alone and together, against the formula
    ``y * (dy - <y, dy>)`` differentiated by torch in fp64."""
    y = torch.softmax(randn(4, 3, 19), 1)
    dy, y_tangent, dy_tangent = (randn(4, 3, 19, scale=1.0) for _ in range(3))
    helpers.softmax_backward(y, dy, 1)  # a plain call keeps the layout's launch first

    def formula(y, dy, dim):
        return y * (dy - (y * dy).sum(dim, keepdim=True))

    for tangents in ((y_tangent, None), (None, dy_tangent), (y_tangent, dy_tangent)):
        results = []
        for backward, inputs in ((helpers.softmax_backward, (y, dy)), (formula, (y.double(), dy.double()))):
            with fwAD.dual_level():
                duals = [t if t_t is None else fwAD.make_dual(t, t_t.to(t.dtype))
                         for t, t_t in zip(inputs, tangents, strict=True)]
                results.append(fwAD.unpack_dual(backward(*duals, 1)).tangent)
        got, want = results
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("y_dtype, dx_dtype, tangent_dtype", [
    (torch.float32, torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32), (torch.float32, torch.float32, torch.float64)])
def test_forward_mode_of_the_backward_dtypes(y_dtype, dx_dtype, tangent_dtype):
    """The tangent of ``dx`` in torch's dtype: ``dx``'s where that is a cast from ``y``'s (the backward of an fp32
    output asked of a bf16 input), else the wider of ``dx``'s and the tangents'; each tangent alone."""
    y = torch.softmax(randn(3, 40), -1).to(y_dtype)
    dy = randn(3, 40, dtype=y_dtype, scale=1.0)
    for y_tangent, dy_tangent in ((randn(3, 40, dtype=tangent_dtype, scale=1.0), None),
                                  (None, randn(3, 40, dtype=tangent_dtype, scale=1.0))):
        results = []
        for backward in (lambda a, b, d: helpers.softmax_backward(a, b, -1, d),
                         lambda a, b, d: torch._softmax_backward_data(b, a, -1, d)):
            with fwAD.dual_level():
                duals = [t if t_t is None else fwAD.make_dual(t, t_t)
                         for t, t_t in ((y, y_tangent), (dy, dy_tangent))]
                results.append(fwAD.unpack_dual(backward(*duals, dx_dtype)).tangent)
        got, want = results
        assert got.dtype == want.dtype
        coarsest = torch.bfloat16 if torch.bfloat16 in (y_dtype, dx_dtype) else y_dtype
        torch.testing.assert_close(got, want, **BACKWARD_TOLERANCE[coarsest])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_forward_mode_and_batched(dim):
    """torch's own checks: forward mode against finite differences, and batched gradients and tangents (torch's
    legacy vmap over the backward and over forward mode), to the second order. ``fast_mode`` checks random
    projections of each Jacobian, in seconds where the full ones take minutes in Triton's interpreter."""
    x = randn(2, 3, 4, dtype=torch.float64, scale=1.0).requires_grad_()
    checks = dict(check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True, fast_mode=True)
    assert torch.autograd.gradcheck(lambda t: helpers.softmax(t, dim), (x,), **checks)
    assert torch.autograd.gradgradcheck(lambda t: helpers.softmax(t, dim), (x,), check_fwd_over_rev=True,
                                        check_batched_grad=True, fast_mode=True)
    y = torch.softmax(randn(2, 3, 4, dtype=torch.float64), dim).requires_grad_()
    dy = randn(2, 3, 4, dtype=torch.float64, scale=1.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: helpers.softmax_backward(a, b, dim), (y, dy), **checks)


@pytest.mark.parametrize("strategy", ["reverse-mode", "forward-mode"])
def test_vectorized_jacobian(strategy):
    """``torch.autograd.functional.jacobian(vectorize=True)`` batches with torch's legacy vmap, whose tensors hold no
    data: the operators take them, and the dispatcher runs them sample by sample."""
    x = randn(3, 5, dtype=torch.float64)
    helpers.softmax(x, 0)  # a plain call keeps the layout's launch first
    got, want = (torch.autograd.functional.jacobian(functools.partial(softmax, dim=0), x, vectorize=True,
                                                    strategy=strategy) for softmax in (helpers.softmax, torch.softmax))
    torch.testing.assert_close(got, want)


# torch.func's transforms of softmax over ``dim`` of the input, each compared with the same transform of torch.softmax
TRANSFORMS = {
    "grad": lambda f, x, t: torch.func.grad(lambda a: (f(a) * t).sum())(x),
    "vjp": lambda f, x, t: torch.func.vjp(f, x)[1](t)[0],
    "jvp": lambda f, x, t: torch.func.jvp(f, (x,), (t,))[1],
    "vmap": lambda f, x, t: torch.func.vmap(f)(x),
    "vmap-last-dim": lambda f, x, t: torch.func.vmap(f, in_dims=-1, out_dims=-1)(x),
    "jacrev": lambda f, x, t: torch.func.jacrev(f)(x),
    "jacfwd": lambda f, x, t: torch.func.jacfwd(f)(x),
    "hessian": lambda f, x, t: torch.func.hessian(lambda a: (f(a) * t).sum())(x),
    "vmap-of-grad": lambda f, x, t: torch.func.vmap(torch.func.grad(lambda a, b: (f(a) * b).sum()))(x, t),
    "vmap-of-jvp": lambda f, x, t: torch.func.vmap(lambda b: torch.func.jvp(f, (x,), (b,))[1])(torch.stack([t, -t])),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape, dim", [((6,), 0), ((3, 7), -1), ((3, 7), 0), ((2, 3, 5), 1), ((2, 3, 5), -2)])
@pytest.mark.parametrize("softmax", AUTOGRAD_SOFTMAXES)
def test_torch_func_transforms(softmax, transform, shape, dim):
    """Each transform of ``helpers.softmax`` and of the autograd.Function, which is handed the dim as given."""
    x, t = randn(*shape, dtype=torch.float64), randn(*shape, dtype=torch.float64, scale=1.0)
    helpers.softmax(x, dim)  # a plain call keeps the layout's launch first
    got = TRANSFORMS[transform](lambda a: softmax(a, dim), x, t)
    want = TRANSFORMS[transform](lambda a: torch.softmax(a, dim), x, t)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "jacfwd"])
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)])
def test_torch_func_with_an_output_dtype(transform, dtype, out_dtype):
    x, t = randn(3, 7, dtype=dtype), randn(3, 7, dtype=dtype, scale=1.0)
    got = TRANSFORMS[transform](lambda a: helpers.softmax(a, -1, out_dtype), x, t)
    want = TRANSFORMS[transform](lambda a: torch.softmax(a, -1, dtype=out_dtype), x, t)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **BACKWARD_TOLERANCE[dtype])


def test_vmap_of_0d_samples_and_of_an_unbatched_y():
    """vmap's samples 0-d (a batch of one-element softmaxes), and ``softmax_backward`` with only ``dy`` batched."""
    x = randn(6, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(helpers.softmax)(x), torch.ones_like(x))
    y = torch.softmax(randn(5, 7, dtype=torch.float64), -1)
    dys = randn(4, 5, 7, dtype=torch.float64, scale=1.0)
    got = torch.func.vmap(helpers.softmax_backward, in_dims=(None, 0))(y, dys)
    want = torch.func.vmap(lambda a, b: torch._softmax_backward_data(b, a, -1, a.dtype), in_dims=(None, 0))(y, dys)
    torch.testing.assert_close(got, want)


def test_plain_calls_inside_a_dual_level():
    """A call with no tangent inside ``dual_level``, and plain calls after the transforms, keep their values."""
    x = randn(4, 9)
    want = torch.softmax(x, -1)
    with fwAD.dual_level():
        torch.testing.assert_close(helpers.softmax(x), want)
    torch.func.grad(lambda a: helpers.softmax(a).sum())(x)
    torch.testing.assert_close(helpers.softmax(x), want)


@pytest.mark.parametrize("path", LAYOUT_PATHS)
def test_functionalize(path):
    """``torch.func.functionalize``'s wrappers answer ``data_ptr()`` with 0: the operator runs for them, forward and
    backward, also after plain calls of the same layouts (whose kept launches must not take them), and autograd
    passes through. Forward mode is refused there: the operator has no forward-mode rule."""
    x, dy, dim = layout_inputs(path, 2)
    y = helpers.softmax(x, dim)
    helpers.softmax_backward(y, dy, dim)  # the layouts' kept launches
    torch.testing.assert_close(torch.func.functionalize(helpers.softmax)(x, dim), torch.softmax(x, dim))
    dx = torch_backward(y, dy, dim).float()
    torch.testing.assert_close(torch.func.functionalize(helpers.softmax_backward)(y, dy, dim), dx)
    x_grad = x.clone().requires_grad_()
    (torch.func.functionalize(helpers.softmax)(x_grad, dim) * dy).sum().backward()
    torch.testing.assert_close(x_grad.grad, dx)
    with pytest.raises(NotImplementedError, match="functionalize"):
        torch.func.jvp(torch.func.functionalize(lambda a: helpers.softmax(a, dim)), (x,), (dy,))
