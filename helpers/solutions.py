"""Reference solutions to notebook 09's exercises. Kept apart from the notebook, which shows stubs; the tests run the
notebook with these in place of the stubs, so every solution is proven by the same checks a learner sees.

``SOLUTIONS`` maps an exercise to the functions (in order) that replace its stub cell.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops import softmax_forward


@triton.jit
def column_softmax_kernel(y_ptr, x_ptr, n_rows, x_row_stride, x_col_stride, y_row_stride, BLOCK_M: tl.constexpr):
    col = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    mask = rows < n_rows
    x = tl.load(x_ptr + rows * x_row_stride + col * x_col_stride, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + rows * y_row_stride + col, e / tl.sum(e, axis=0), mask=mask)


def column_softmax(x: torch.Tensor) -> torch.Tensor:
    n_rows, n_cols = x.shape
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous, as torch returns it, whatever x's strides
    column_softmax_kernel[(n_cols,)](y, x, n_rows, x.stride(0), x.stride(1), y.stride(0),
                                     BLOCK_M=triton.next_power_of_2(n_rows))
    return y


def temperature_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return softmax_forward(x / temperature, dim=-1)


@triton.jit
def log_softmax_kernel(y_ptr, x_ptr, x_row_stride, y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    d = tl.sum(tl.exp(x - m), axis=0)
    tl.store(y_ptr + row * y_row_stride + cols, x - m - tl.log(d), mask=mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()  # the kernel takes neighbouring columns
    y = torch.empty_like(x)
    log_softmax_kernel[(x.shape[0],)](y, x, x.stride(0), y.stride(0), x.shape[1],
                                      BLOCK_SIZE=triton.next_power_of_2(x.shape[1]))
    return y


@triton.jit
def scaled_softmax_kernel(y_ptr, x_ptr, scale, x_row_stride, y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    z = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32) * scale
    e = tl.exp(z - tl.max(z, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, e / tl.sum(e, axis=0), mask=mask)


def scaled_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    x = x.contiguous()  # the kernel takes neighbouring columns
    y = torch.empty_like(x)
    scaled_softmax_kernel[(x.shape[0],)](y, x, scale, x.stride(0), y.stride(0), x.shape[1],
                                         BLOCK_SIZE=triton.next_power_of_2(x.shape[1]))
    return y


# How the course's fused kernels cut each shape: (rows per program, programs per row), as plans.plan_for decides.
predicted_plans = {"wide": (1, 1), "tall": (8, 1), "square": (1, 1), "vocabulary": (1, 13)}


@triton.jit
def causal_softmax_kernel(y_ptr, x_ptr, x_row_stride, y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    visible = cols <= row  # row i sees columns 0..i
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=visible & (cols < n_cols), other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * y_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


def causal_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()  # the kernel takes neighbouring columns
    y = torch.empty_like(x)
    causal_softmax_kernel[(x.shape[0],)](y, x, x.stride(0), y.stride(0), x.shape[1],
                                         BLOCK_SIZE=triton.next_power_of_2(x.shape[1]))
    return y


SOLUTIONS = {
    "column_softmax": [column_softmax_kernel, column_softmax],
    "temperature_softmax": [temperature_softmax],
    "log_softmax": [log_softmax_kernel, log_softmax],
    "scaled_softmax": [scaled_softmax_kernel, scaled_softmax],
    "predicted_plans": ["predicted_plans"],
    "causal_softmax": [causal_softmax_kernel, causal_softmax],
}
