"""The PyTorch oracles agree with torch and with each other."""

import pytest
import torch
from conftest import randn

from helpers import reference


def test_naive_softmax_matches_torch():
    x = randn(13, 29, dtype=torch.float64)
    for dim in (0, 1):
        torch.testing.assert_close(reference.naive_softmax(x, dim), torch.softmax(x, dim))


def test_unsafe_softmax_overflows_where_safe_does_not():
    x = torch.tensor([[1000.0, 1001.0, 1002.0]])
    assert reference.unsafe_softmax(x).isnan().all()
    torch.testing.assert_close(reference.naive_softmax(x), torch.softmax(x, -1))


def test_jacobian_matches_autograd():
    x = randn(7, dtype=torch.float64)
    expected = torch.autograd.functional.jacobian(lambda t: torch.softmax(t, 0), x)
    torch.testing.assert_close(reference.softmax_jacobian(torch.softmax(x, 0)), expected)


def test_jacobian_free_backward_matches_jacobian():
    y = torch.softmax(randn(5, 11, dtype=torch.float64), -1)
    dy = randn(5, 11, dtype=torch.float64)
    torch.testing.assert_close(reference.softmax_backward(y, dy), reference.jacobian_backward(y, dy))
    torch.testing.assert_close(reference.softmax_backward(y, dy),
                               torch._softmax_backward_data(dy, y, -1, torch.float64))


def test_assert_close_on_scale_catches_what_the_default_tolerance_passes():
    """Over a long row every gradient is about 1/N: a backward that drops <y, dy> passes assert_close's default
    absolute tolerance there, and fails one set by the gradient's own scale, which the right backward passes."""
    y = torch.softmax(randn(4, 2**18, scale=1.0), -1)
    dy = randn(4, 2**18, scale=1.0)
    expected = reference.softmax_backward(y.double(), dy.double()).float()
    reference.assert_close_on_scale(reference.softmax_backward(y, dy), expected)
    without_dot = y * dy
    torch.testing.assert_close(without_dot, expected)
    with pytest.raises(AssertionError):
        reference.assert_close_on_scale(without_dot, expected)
