"""Softmax over a dim that is not the last, without moving it there (notebook 06).

A contiguous tensor is seen as (outer, R, inner): softmax runs along R, whose elements lie ``inner`` apart in memory.
Each program owns BLOCK_C neighbouring columns of one outer index and holds their whole length (BLOCK_R, R's next
power of two) in registers, so it reads its input once and writes its output once, in the input's own layout: no
transpose copy, and the output comes out contiguous, as torch's does. Neighbouring columns are neighbours in memory,
so each of a program's R rows is one contiguous run of BLOCK_C elements. A dim too long to hold is walked twice
instead (notebook 05's online softmax, down the columns). Notebook 08's column exercise is the small version of these
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused import LOG2E
from .kernels import launch, upcast

# Each row of a program's block is a run of WIDE_RUN_BYTES (64 fp32 or 128 16-bit columns), or NARROW_RUN_BYTES from
# LONG_COLUMN rows on, never under MIN_COLUMNS columns; a warp per WARP_BYTES that the block holds (both inputs of the
# backward), 2 to 16. Longer dims than MAX_REDUCED would not fit: they are walked (below). Measured on the H100 against
# every block of 16-256 columns and 2-16 warps, in results/nvidia-h100-80gb-hbm3-columns.csv.
WIDE_RUN_BYTES = 256
NARROW_RUN_BYTES = 64
LONG_COLUMN = 512
MIN_COLUMNS = 16
MAX_REDUCED = 1024
WARP_BYTES = 8192
# Longer dims are walked twice by programs of LOOPED_COLUMNS columns, LOOPED_ROWS rows at a time, LOOPED_WARPS warps:
# 3 transfers for the forward's 2, 5 for the backward's 3. Dim 0 of (32768, 4096) fp32 on the H100: 0.55 of copy
# forward and 0.57 backward, against 0.28 and 0.09 through strided rows (16-32 columns, 64-256 rows, 4-8 warps). It
# takes at least LOOPED_MIN_PROGRAMS of them: fewer leave the GPU idle, and the rows path shares a row among programs.
LOOPED_COLUMNS = 32
LOOPED_ROWS = 256
LOOPED_WARPS = 8
LOOPED_MIN_PROGRAMS = 128


@dataclass(frozen=True)
class ColumnPlan:
    block_r: int
    block_c: int
    num_warps: int
    looped: bool = False  # BLOCK_R rows at a time down a longer dim


def column_plan(n_reduced: int, n_inner: int, element_size: int, n_inputs: int = 1) -> ColumnPlan:
    """The block of a column program for a dim of ``n_reduced`` elements ``n_inner`` apart, reading ``n_inputs``
    tensors: held whole up to MAX_REDUCED elements, walked past that. Symbolic sizes (torch.compile's dynamic shapes)
    are made concrete, as in ``fused.plan_for``."""
    n_reduced, n_inner = int(n_reduced), int(n_inner)
    if n_reduced > MAX_REDUCED:
        return ColumnPlan(LOOPED_ROWS, LOOPED_COLUMNS, LOOPED_WARPS, looped=True)
    block_r = triton.next_power_of_2(n_reduced)
    run_bytes = NARROW_RUN_BYTES if block_r >= LONG_COLUMN else WIDE_RUN_BYTES
    block_c = max(MIN_COLUMNS, min(run_bytes // element_size, triton.next_power_of_2(n_inner)))
    warps = triton.next_power_of_2(max(1, block_r * block_c * element_size * n_inputs // WARP_BYTES))
    return ColumnPlan(block_r, block_c, num_warps=min(16, max(2, warps)))


def takes_columns(dim: int, *tensors: torch.Tensor) -> bool:
    """Whether softmax over ``dim`` of these contiguous fp16/bf16/fp32 tensors runs down their columns, here: a dim
    that is not the last and has neighbours (inner > 1: otherwise it is a contiguous row), held whole, or walked by
    at least LOOPED_MIN_PROGRAMS programs."""
    t = tensors[0]
    if not (0 <= dim < t.ndim - 1 and all(u.is_contiguous() and u.dtype != torch.float64 for u in tensors)):
        return False
    n_outer, n_reduced, n_inner = _sizes(t, dim)
    return n_inner > 1 and (n_reduced <= MAX_REDUCED
                            or n_outer * triton.cdiv(n_inner, LOOPED_COLUMNS) >= LOOPED_MIN_PROGRAMS)


def _sizes(t: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """(outer, R, inner) of a contiguous ``t`` around ``dim``."""
    outer, inner = 1, 1
    for size in t.shape[:dim]:
        outer *= size
    for size in t.shape[dim + 1:]:
        inner *= size
    return outer, t.shape[dim], inner


@triton.jit
def column_block(pid, n_reduced, n_inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Offsets and mask of program ``pid``'s block: BLOCK_R x BLOCK_C elements, R down, columns across."""
    blocks = tl.cdiv(n_inner, BLOCK_C)
    outer, block = pid // blocks, pid % blocks
    r = tl.arange(0, BLOCK_R)[:, None]
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    return outer * n_reduced * n_inner + r * n_inner + c, (r < n_reduced) & (c < n_inner)


@triton.jit
def softmax_column_kernel(y_ptr, x_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Forward: each column's max m and denominator d down its R elements, then y = exp(x - m) / d."""
    offsets, mask = column_block(tl.program_id(0).to(tl.int64), n_reduced, n_inner, BLOCK_R, BLOCK_C)
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a column of -inf: exp gives 0s, and 0 / 0 the NaNs torch gives
    e = tl.exp2((x - m[None, :]) * LOG2E)
    d = tl.sum(e, axis=0)
    tl.store(y_ptr + offsets, e * (1.0 / d)[None, :], mask=mask)


@triton.jit
def softmax_backward_column_kernel(dx_ptr, y_ptr, dy_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr,
                                   BLOCK_C: tl.constexpr):
    """Backward: dx = y * (dy - sum(y * dy)), the sum down each column."""
    offsets, mask = column_block(tl.program_id(0).to(tl.int64), n_reduced, n_inner, BLOCK_R, BLOCK_C)
    y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    s = tl.sum(y * dy, axis=0)
    tl.store(dx_ptr + offsets, y * (dy - s[None, :]), mask=mask)


@triton.jit
def column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R: tl.constexpr):
    """Offsets and mask of the BLOCK_R rows from ``start`` of a looped program's columns ``c``."""
    r = start + tl.arange(0, BLOCK_R)[:, None]
    return base + r * n_inner + c[None, :], (r < n_reduced) & (c[None, :] < n_inner)


@triton.jit
def softmax_column_looped_kernel(y_ptr, x_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Forward for dims too long to hold: each program walks its columns down twice, BLOCK_R rows at a time. The first
    walk keeps each column's running (m, d) (notebook 05's online softmax), the second writes exp(x - m) / d."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(n_inner, BLOCK_C)
    base, c = pid // blocks * n_reduced * n_inner, pid % blocks * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    d = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, n_reduced, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((x - m_safe[None, :]) * LOG2E), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    d_inverse = 1.0 / d
    for start in range(0, n_reduced, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")))
        tl.store(y_ptr + offsets, tl.exp2((x - m[None, :]) * LOG2E) * d_inverse[None, :], mask=mask)


@triton.jit
def softmax_backward_column_looped_kernel(dx_ptr, y_ptr, dy_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr,
                                          BLOCK_C: tl.constexpr):
    """Backward for dims too long to hold: a first walk sums y * dy down each column, a second writes dx."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(n_inner, BLOCK_C)
    base, c = pid // blocks * n_reduced * n_inner, pid % blocks * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, n_reduced, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
        s += tl.sum(y * upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0)), axis=0)
    for start in range(0, n_reduced, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        tl.store(dx_ptr + offsets, y * (dy - s[None, :]), mask=mask)


def _launch(kernels: tuple, out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dim: int) -> None:
    """The held kernel of ``kernels`` or the looped one, as ``column_plan`` says."""
    n_outer, n_reduced, n_inner = _sizes(out, dim)
    plan = column_plan(n_reduced, n_inner, max(t.element_size() for t in inputs), len(inputs))
    grid = (n_outer * triton.cdiv(n_inner, plan.block_c),)
    launch(kernels[plan.looped], grid, out, *inputs, n_reduced, n_inner, BLOCK_R=plan.block_r, BLOCK_C=plan.block_c,
           num_warps=plan.num_warps)


def launch_forward(x: torch.Tensor, y: torch.Tensor, dim: int) -> None:
    """y = softmax(x, dim) for contiguous x and y (``takes_columns``)."""
    _launch((softmax_column_kernel, softmax_column_looped_kernel), y, (x,), dim)


def launch_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, dim: int) -> None:
    """dx from y and dy, all contiguous (``takes_columns``)."""
    _launch((softmax_backward_column_kernel, softmax_backward_column_looped_kernel), dx, (y, dy), dim)
