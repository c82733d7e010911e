"""Hypothesis-generated shapes, dims, dtypes and values (special values included) against torch."""

import math

import torch
from conftest import TOLERANCE, torch_backward
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers

SPECIAL = [0.0, 1.0, -1.0, 88.7, -88.7, 1e4, -1e4, 3e38, -3e38, math.inf, -math.inf, math.nan]
DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])


@st.composite
def tensors(draw, special=True):
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple))
    dim = draw(st.integers(-max(len(shape), 1), max(len(shape), 1) - 1))
    dtype = draw(DTYPES)
    x = torch.randn(shape, dtype=torch.float64) * draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    if special and x.numel():
        n_special = draw(st.integers(0, min(3, x.numel())))
        for _ in range(n_special):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()) and x.ndim >= 2:
        x = x.transpose(0, -1)  # non-contiguous
    return x.to(dtype=dtype, device=helpers.DEVICE), dim


@settings(max_examples=80, deadline=None)
@given(tensors())
def test_forward_matches_torch(case):
    x, dim = case
    torch.testing.assert_close(helpers.softmax_forward(x, dim), torch.softmax(x, dim), equal_nan=True,
                               **TOLERANCE[x.dtype])


@settings(max_examples=60, deadline=None)
@given(tensors(special=False), st.booleans())
def test_backward_matches_torch(case, broadcast_grad):
    x, dim = case
    y = torch.softmax(x, dim)
    dy = torch.randn(x.shape, dtype=torch.float64).to(dtype=x.dtype, device=x.device)
    if broadcast_grad and x.ndim and x.shape[dim]:
        dy = dy.select(dim, 0).unsqueeze(dim).expand_as(x)  # a zero stride along the softmax dim
    dx = helpers.softmax_backward(y, dy, dim)
    atol = {torch.float16: 4e-3, torch.bfloat16: 4e-2}.get(x.dtype, 1e-6)
    torch.testing.assert_close(dx.double(), torch_backward(y, dy, dim), atol=atol, rtol=atol)
