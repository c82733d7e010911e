"""The course's Triton kernels, one source each, with the launchers that size their grids.

Every kernel works on a 2-D view of rows: row ``r``, column ``c`` of ``x`` is at ``x_ptr + r * x_row_stride +
c * x_col_stride``. Outputs are always allocated contiguous by the caller, so they need only a row stride. Math names
follow the course's table of symbols: ``x`` input, ``y`` softmax output, ``dy``/``dx`` gradients, ``m`` row max,
``d`` denominator (sum of exponentials).
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .device import INTERPRET

# Rows up to this many elements are held in one block by one program; longer rows loop over LOOP_BLOCK_SIZE chunks.
ROW_BLOCK_LIMIT = 8192
LOOP_BLOCK_SIZE = 2048


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds data to launch on: a torch.Tensor, or a subclass that dispatches as one (nn.Parameter),
    not a traced tensor (a FakeTensor carries only shapes; a FunctionalTensor wraps another)."""
    return type(t) is torch.Tensor or (isinstance(t, torch.Tensor)
                                       and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


# Triton's interpreter keeps the grid it runs in one place for the whole process, so two threads' launches at once
# would mix: launches with data run one at a time.
_one_launch_at_a_time = threading.Lock()


def launch(kernel, grid: tuple[int, ...], *args, **options) -> None:
    """``kernel[grid](*args, **options)``, in a form that torch.compile and torch.library can trace (notebook 08).

    Tensors with data launch directly. Traced tensors (FakeTensors that carry only shapes, FunctionalTensors) launch
    through ``torch.library.wrap_triton``, which records the kernel call in the graph. Triton's interpreter cannot be
    traced: a traced tensor there has no data to run on, so nothing is launched (helpers.ops makes the op opaque on
    CPU).
    """
    if all(has_data(a) for a in args if isinstance(a, torch.Tensor)):
        with _one_launch_at_a_time:
            kernel[grid](*args, **options)
    elif not INTERPRET:
        wrap_triton(kernel)[grid](*args, **options)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the kernels compute in (``upcast`` in a kernel): fp64 where a tensor is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@triton.jit
def upcast(x):
    """fp16/bf16 (and fp32) compute in fp32, fp64 stays fp64: low precisions are only a storage format."""
    if x.dtype == tl.float64:
        out = x
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def softmax_kernel(
    y_ptr,  # output, contiguous rows
    x_ptr,  # input
    x_row_stride,  # elements between x[r, 0] and x[r + 1, 0]
    x_col_stride,  # elements between x[r, c] and x[r, c + 1] (1 for a contiguous row)
    y_row_stride,
    n_cols,  # N, the length of a row
    BLOCK_SIZE: tl.constexpr,  # a power of two >= N: the whole row in one block
):
    """Forward, one program per row: load the row once, max, exp, sum, divide, store."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit so row * stride cannot overflow on large tensors
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    # Padding lanes read -inf: they cannot win the max, and exp(-inf) = 0 adds nothing to the sum.
    x = upcast(tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=float("-inf")))
    m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    d = tl.sum(e, axis=0)
    y = e / d
    tl.store(y_ptr + row * y_row_stride + cols, y, mask=mask)


@triton.jit
def softmax_online_kernel(y_ptr, x_ptr, x_row_stride, x_col_stride, y_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    """Forward for rows of any length, one program per row, two passes over BLOCK_SIZE chunks.

    Pass 1 keeps the running max ``m`` and denominator ``d`` (online softmax): when a chunk raises the max, the sum so
    far is rescaled by exp(m_old - m_new). Pass 2 reads x again and writes exp(x - m) / d.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    d = upcast(tl.zeros((), x_ptr.dtype.element_ty))  # 0 in the compute dtype
    m = d - float("inf")
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        x = upcast(tl.load(x_row + cols * x_col_stride, mask=cols < n_cols, other=float("-inf")))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every value seen is -inf there is nothing to rescale: subtract 0 instead of -inf (-inf - -inf = NaN).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - m_shift) + tl.sum(tl.exp(x - m_shift), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        x = upcast(tl.load(x_row + cols * x_col_stride, mask=mask, other=float("-inf")))
        tl.store(y_row + cols, tl.exp(x - m) / d, mask=mask)


@triton.jit
def softmax_backward_kernel(
    dx_ptr,  # output gradient, contiguous rows
    y_ptr,  # the forward output
    dy_ptr,  # incoming gradient (may have zero strides: y.sum().backward() passes an expanded tensor)
    y_row_stride,
    y_col_stride,
    dy_row_stride,
    dy_col_stride,
    dx_row_stride,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
):
    """Jacobian-free backward, one program per row: dx = y * (dy - sum(y * dy))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    y = upcast(tl.load(y_ptr + row * y_row_stride + cols * y_col_stride, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0))
    dot = tl.sum(y * dy, axis=0)
    tl.store(dx_ptr + row * dx_row_stride + cols, y * (dy - dot), mask=mask)


@triton.jit
def softmax_backward_looped_kernel(
    dx_ptr, y_ptr, dy_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_cols,
    BLOCK_SIZE: tl.constexpr,
):
    """Jacobian-free backward for rows of any length: pass 1 sums y * dy chunk by chunk, pass 2 writes dx."""
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * y_row_stride
    dy_row = dy_ptr + row * dy_row_stride
    acc = upcast(tl.zeros((BLOCK_SIZE,), y_ptr.dtype.element_ty))  # a partial sum per lane, added up once at the end
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        y = upcast(tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0))
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        y = upcast(tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0))
        tl.store(dx_ptr + row * dx_row_stride + cols, y * (dy - dot), mask=mask)


@triton.jit
def softmax_graph_backward_kernel(
    dx_ptr, x_ptr, dy_ptr, x_row_stride, x_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_cols,
    BLOCK_SIZE: tl.constexpr,
):
    """Backward by the computational graph, one program per row: recompute the forward from x, then send dy back
    through each node in reverse order. Each gradient is named after the node it belongs to (dm = dL/dm, ...)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = upcast(tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=float("-inf")))
    dy = upcast(tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0))
    # forward again: m = max(x), z = x - m, e = exp(z), d = sum(e), r = 1 / d, y = e * r
    m = tl.max(x, axis=0)
    z = x - m
    e = tl.exp(z)
    d = tl.sum(e, axis=0)
    r = 1.0 / d
    # y = e * r: both inputs get a share. r is one number used by every lane, so its gradient sums over the row.
    de = dy * r
    dr = tl.sum(dy * e, axis=0)
    # r = 1 / d: dr/dd = -1 / d^2
    dd = dr * (-r * r)
    # d = sum(e): every e adds to d, so dd flows back to every lane (a broadcast)
    de += dd
    # e = exp(z): the derivative of exp is exp itself
    dz = de * e
    # z = x - m: x gets dz directly; m was subtracted from every lane, so it collects -sum(dz) (padding lanes: e = 0)
    dm = -tl.sum(dz, axis=0)
    # m = max(x): the max branch routes dm to the lanes that hold the max (split evenly between ties, as torch.amax)
    is_max = (x == m) & mask
    dx = dz + tl.where(is_max, dm / tl.sum(is_max.to(x.dtype), axis=0), 0.0)
    tl.store(dx_ptr + row * dx_row_stride + cols, dx, mask=mask)


def launch_graph_backward(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """dx of each row by the graph kernel, from the forward *input* ``x`` and ``dy`` (rows must fit in one block)."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    if block > ROW_BLOCK_LIMIT:
        raise ValueError(f"the graph backward keeps a whole row in one block: N = {n_cols} is over {ROW_BLOCK_LIMIT}")
    launch(
        softmax_graph_backward_kernel, (n_rows,),
        dx, x, dy, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), n_cols,
        BLOCK_SIZE=block, num_warps=num_warps_for(block),
    )


def num_warps_for(block_size: int) -> int:
    """More warps for wider blocks, so each thread holds a bounded slice of the row."""
    return 4 if block_size < 2048 else 8 if block_size < 4096 else 16


ONE_BLOCK_KERNELS = (softmax_kernel, softmax_backward_kernel)


def _block_for(kernel, n_cols: int) -> int:
    """One-block kernels need the whole row in a block; looped kernels walk it in LOOP_BLOCK_SIZE chunks."""
    return triton.next_power_of_2(n_cols) if kernel in ONE_BLOCK_KERNELS else LOOP_BLOCK_SIZE


def launch_forward(x: torch.Tensor, y: torch.Tensor, kernel=None) -> None:
    """Softmax of each row of the 2-D ``x`` into the contiguous 2-D ``y``, one program per row.

    ``kernel`` defaults to the one-block kernel when the row fits in ROW_BLOCK_LIMIT, else the looped one.
    """
    n_rows, n_cols = x.shape
    if kernel is None:
        fits = triton.next_power_of_2(n_cols) <= ROW_BLOCK_LIMIT
        kernel = softmax_kernel if fits else softmax_online_kernel
    block = _block_for(kernel, n_cols)
    launch(
        kernel, (n_rows,),
        y, x, x.stride(0), x.stride(1), y.stride(0), n_cols, BLOCK_SIZE=block, num_warps=num_warps_for(block),
    )


def launch_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, kernel=None) -> None:
    """dx of each row from the 2-D ``y`` and ``dy`` into the contiguous 2-D ``dx``, one program per row."""
    n_rows, n_cols = y.shape
    if kernel is None:
        fits = triton.next_power_of_2(n_cols) <= ROW_BLOCK_LIMIT
        kernel = softmax_backward_kernel if fits else softmax_backward_looped_kernel
    block = _block_for(kernel, n_cols)
    launch(
        kernel, (n_rows,),
        dx, y, dy, y.stride(0), y.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), n_cols,
        BLOCK_SIZE=block, num_warps=num_warps_for(block),
    )

