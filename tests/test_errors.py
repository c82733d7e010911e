"""What the ops refuse, and that they say why."""

import numpy as np
import pytest
import torch
from conftest import randn

import helpers


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("op", [helpers.softmax, helpers.softmax_forward])
def test_non_float_input(op, dtype):
    x = torch.ones(3, 4, device=helpers.DEVICE).to(dtype)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        op(x)


@pytest.mark.parametrize("dtype, result_dtype", [(torch.int64, None), (torch.bool, None), (torch.complex64, None),
                                                 (torch.float32, torch.int32), (torch.int64, torch.uint8)])
def test_empty_tensors_of_any_dtype(dtype, result_dtype):
    """Nothing to compute: torch returns an empty tensor whatever the dtype, which it refuses with elements."""
    x = torch.empty(0, 3, dtype=dtype, device=helpers.DEVICE)
    y = helpers.softmax(x, -1, result_dtype)
    assert y.shape == (0, 3) and y.dtype == torch.softmax(x, -1, result_dtype).dtype
    with pytest.raises(IndexError, match="Dimension out of range"):
        helpers.softmax(x, 2, result_dtype)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="torch.Tensor"):
        helpers.softmax_forward([1.0, 2.0])


def test_non_float_grad():
    y = torch.softmax(randn(3, 4), -1)
    with pytest.raises(TypeError, match="dy has dtype torch.int64"):
        helpers.softmax_backward(y, torch.ones(3, 4, dtype=torch.int64, device=helpers.DEVICE))


@pytest.mark.parametrize("shape, dim", [((3, 4), 2), ((3, 4), -3), ((), 1), ((5,), -2)])
def test_dim_out_of_range(shape, dim):
    x = randn(*shape)
    for call in (lambda: helpers.softmax_forward(x, dim), lambda: helpers.softmax(x, dim),
                 lambda: helpers.softmax_backward(x, x, dim)):
        with pytest.raises(IndexError, match="Dimension out of range"):
            call()
    with pytest.raises(IndexError):  # torch refuses the same dims
        torch.softmax(x, dim)


def test_shape_mismatch():
    with pytest.raises(ValueError, match=r"same shape, got \(3, 4\) and \(4, 3\)"):
        helpers.softmax_backward(randn(3, 4), randn(4, 3))


@pytest.mark.parametrize("dim", [1.0, True, None, "1", torch.tensor(True), torch.tensor([1]), np.array(1)],
                         ids=["float", "bool", "None", "str", "bool tensor", "1-d tensor", "numpy array"])
def test_dim_must_be_an_int(dim):
    """torch refuses a dim that is not an int, even one equal to an int's value, which a layout called before with
    that int must not take for it."""
    x = randn(3, 4)
    helpers.softmax(x, 1), helpers.softmax_backward(x, x, 1)
    for call in (lambda: helpers.softmax(x, dim), lambda: helpers.softmax_backward(x, x, dim),
                 lambda: helpers.graph_softmax(x, dim)):
        with pytest.raises(TypeError, match=f"dim must be an int, not {type(dim).__name__}"):
            call()
    with pytest.raises((TypeError, RuntimeError)):  # torch 2.11 takes None and "1" for dim names, which x lacks
        torch.softmax(x, dim)


@pytest.mark.parametrize("dim", [np.int64(0), torch.tensor(0)], ids=["numpy integer", "0-d integer tensor"])
def test_integer_dims(dim):
    """The integers torch takes for an int."""
    x = randn(3, 4)
    y = torch.softmax(x, dim)
    torch.testing.assert_close(helpers.softmax(x, dim), y)
    torch.testing.assert_close(helpers.softmax_backward(y, x, dim), helpers.softmax_backward(y, x, 0))
    torch.testing.assert_close(helpers.graph_softmax(x, dim), y)


@pytest.mark.parametrize("layout", ["sparse", "sparse-csr"])
def test_sparse_tensors(layout):
    """torch.softmax refuses sparse tensors; so do the ops, and say why. (Nested ones: test_forward.)"""
    dense = randn(3, 4)
    x = {"sparse": dense.to_sparse, "sparse-csr": dense.to_sparse_csr}[layout]()
    for call in (lambda: helpers.softmax(x), lambda: helpers.softmax_backward(x, x)):
        with pytest.raises(NotImplementedError, match=r"the kernels take dense \(strided\) tensors"):
            call()


def test_a_batch_that_escaped_vmap():
    """torch refuses a tensor of a vmap batch used after its function returned; so do the ops, rather than loop."""
    escaped = []
    torch.func.vmap(lambda t: escaped.append(t) or t)(randn(3, 5))
    for call in (lambda t: helpers.softmax(t), lambda t: helpers.softmax_backward(t, t)):
        with pytest.raises(RuntimeError, match="escaped from the function being vmapped"):
            call(escaped[0])
    with pytest.raises(RuntimeError, match="escaped"):
        torch.softmax(escaped[0], -1)
