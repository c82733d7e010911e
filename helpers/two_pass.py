"""Two passes (notebook 06): rows too long for a split's programs to be resident together, and fp64 rows, take two
launches in which no program waits for another: statistics, then finish, re-reading the row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import plans
from .device import INTERPRET
from .exchange import FINISH, STATISTICS
from .kernels import compute_dtype, upcast
from .recipes import Buffer, Recipe, Step
from .tiles import KEEP_IN_L2, LOG2E

# The two-pass kernels store their outputs streaming (evict first), so that they push out of L2 as little as possible
# of the row still to be read again (H100, one row of 2**22 + 3 fp32: forward 0.78 -> 0.83 of copy, GPU time).
STREAMING = tl.constexpr(".cs")
# ... and read what L2 cannot keep for the re-read with this policy, so that it does not push out what it can
# (``kept_programs``).
PASS_THROUGH_L2 = tl.constexpr("evict_first")


# ``kept_programs`` is a bound on program ids, which nothing gains from Triton specialising on its divisibility by 16
# (a compile per case; and torch 2.11's torch.compile misreads an argument so specialised under Triton 3.9).
@triton.jit(do_not_specialize=["kept_programs"])
def softmax_two_pass_kernel(
    y_ptr, x_ptr, m_ptr, d_ptr, x_row_stride, x_col_stride, y_row_stride, n_cols, chunks, chunk_blocks, kept_programs,
    CHUNKS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Forward for rows too long for a split's programs to be resident together, in two launches in which no program
    waits for another. ``chunks`` programs share a row, each taking every ``chunks``-th block of BLOCK_N (up to
    ``chunk_blocks`` of them), so that together they sweep the row from its start to its end. STATISTICS reduces each
    program's blocks to a partial (m, d): one max per block, the sum kept per lane and rescaled when the max rises
    (notebook 05). FINISH merges the row's partials and writes y = exp(x - m) / d, reading x again, in the opposite
    order: programs and blocks from the last, so the re-read starts where STATISTICS ended, in what L2 still holds.
    Only the last ``kept_programs`` programs' blocks are loaded to stay in L2; the rest pass through it."""
    program = tl.program_id(0)
    if PHASE == FINISH:
        program = tl.num_programs(0) - 1 - program
    row, chunk = (program // chunks).to(tl.int64), program % chunks
    x_row = x_ptr + row * x_row_stride
    block = tl.arange(0, BLOCK_N)
    if PHASE == STATISTICS:
        d = upcast(tl.zeros((BLOCK_N,), x_ptr.dtype.element_ty))  # per lane, in the compute dtype
        m = tl.max(d, axis=0) - float("inf")
        for i in range(chunk_blocks):
            cols = (i * chunks + chunk).to(tl.int64) * BLOCK_N + block  # 64-bit: a row can pass 2**31 elements
            if program >= tl.num_programs(0) - kept_programs:
                x = upcast(tl.load(x_row + cols * x_col_stride, mask=cols < n_cols, other=float("-inf"),
                                   eviction_policy=KEEP_IN_L2))
            else:
                x = upcast(tl.load(x_row + cols * x_col_stride, mask=cols < n_cols, other=float("-inf"),
                                   eviction_policy=PASS_THROUGH_L2))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: nothing to rescale
            d = d * tl.exp2((m - m_shift) * LOG2E) + tl.exp2((x - m_shift) * LOG2E)
            m = m_new
        tl.store(m_ptr + program, m)
        tl.store(d_ptr + program, tl.sum(d, axis=0))
    else:
        parts = tl.arange(0, CHUNKS_POW2)
        m_parts = tl.load(m_ptr + row * chunks + parts, mask=parts < chunks, other=float("-inf"))
        d_parts = tl.load(d_ptr + row * chunks + parts, mask=parts < chunks, other=0.0)
        m_row = tl.max(m_parts, axis=0)
        d_row = tl.sum(d_parts * tl.exp2((m_parts - tl.where(m_row == float("-inf"), 0.0, m_row)) * LOG2E), axis=0)
        d_inverse = 1.0 / d_row
        for i_from_end in range(chunk_blocks):
            cols = ((chunk_blocks - 1 - i_from_end) * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            x = upcast(tl.load(x_row + cols * x_col_stride, mask=mask, other=float("-inf"),
                               eviction_policy=KEEP_IN_L2))
            tl.store(y_ptr + row * y_row_stride + cols, tl.exp2((x - m_row) * LOG2E) * d_inverse, mask=mask,
                     cache_modifier=STREAMING)


@triton.jit(do_not_specialize=["kept_programs"])
def softmax_backward_two_pass_kernel(
    dx_ptr, y_ptr, dy_ptr, dot_ptr, y_row_stride, y_col_stride, dy_row_stride, dy_col_stride, dx_row_stride, n_cols,
    chunks, chunk_blocks, kept_programs, CHUNKS_POW2: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr,
):
    """Backward in two launches, swept and cached like the forward: STATISTICS sums y * dy over a program's blocks,
    FINISH adds up the row's sums and writes dx = y * (dy - sum), in the opposite order."""
    program = tl.program_id(0)
    if PHASE == FINISH:
        program = tl.num_programs(0) - 1 - program
    row, chunk = (program // chunks).to(tl.int64), program % chunks
    y_row, dy_row = y_ptr + row * y_row_stride, dy_ptr + row * dy_row_stride
    block = tl.arange(0, BLOCK_N)
    if PHASE == STATISTICS:
        zeros = tl.zeros((BLOCK_N,), tl.float32)
        dot = upcast(zeros.to(y_ptr.dtype.element_ty)) * upcast(zeros.to(dy_ptr.dtype.element_ty))  # fp64 if either is
        for i in range(chunk_blocks):
            cols = (i * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            if program >= tl.num_programs(0) - kept_programs:
                y = tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
                dy = tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
            else:
                y = tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=PASS_THROUGH_L2)
                dy = tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=PASS_THROUGH_L2)
            dot += upcast(y) * upcast(dy)
        tl.store(dot_ptr + program, tl.sum(dot, axis=0))
    else:
        parts = tl.arange(0, CHUNKS_POW2)
        dot = tl.sum(tl.load(dot_ptr + row * chunks + parts, mask=parts < chunks, other=0.0), axis=0)
        for i_from_end in range(chunk_blocks):
            cols = ((chunk_blocks - 1 - i_from_end) * chunks + chunk).to(tl.int64) * BLOCK_N + block
            mask = cols < n_cols
            y = upcast(tl.load(y_row + cols * y_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2))
            dy = upcast(tl.load(dy_row + cols * dy_col_stride, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2))
            tl.store(dx_ptr + row * dx_row_stride + cols, y * (dy - dot), mask=mask, cache_modifier=STREAMING)


# The two-pass kernels share a row among at most MAX_CHUNKS programs, each taking blocks of TWO_PASS_BLOCK_BYTES with
# TWO_PASS_WARPS warps: the best of 2 block sizes, 2 warp counts and 2 chunk limits on the H100 for single rows of
# 2**22 + 3 and 2**24 elements, fp32 and bf16 (results/nvidia-h100-80gb-hbm3-long-rows-tuning.md).
TWO_PASS_BLOCK_BYTES = 16384
MAX_CHUNKS = 2048
TWO_PASS_WARPS = 8


def two_pass_chunks(n_cols: int, element_size: int) -> tuple[int, int, int]:
    """(block elements, chunks per row, blocks per chunk) of the two-pass kernels for rows of ``n_cols``."""
    block_n = TWO_PASS_BLOCK_BYTES // element_size
    blocks = plans.cdiv(n_cols, block_n)
    chunk_blocks = plans.cdiv(blocks, MAX_CHUNKS)
    return block_n, plans.cdiv(blocks, chunk_blocks), chunk_blocks


# How much of L2 the statistics launch asks to keep for the finish: the blocks its last programs read, which the finish
# reads first. Keeping everything keeps nothing once a row outgrows L2 (each new line evicts one still to be re-read);
# on the H100 (50 MB), of 0, 1/4, 1/3, 1/2, 2/3 and everything, a half was best or level with the best at one row of
# 2**24 elements (fp32 forward 0.67 of copy keeping everything, 0.70 a half; bf16 0.66 and 0.70) and two rows of 2**22
# (fp32 backward 0.66 and 0.70), and changed nothing at 2**22 + 3 and 2**27 (results/*-long-rows-tuning.md).
KEPT_L2_FRACTION = 1 / 2


def two_pass_recipe(kernel, operands: tuple[torch.Tensor, ...], strides: tuple, n_rows: int, n_cols: int,
                     partials: int) -> Recipe:
    """STATISTICS then FINISH, sharing ``partials`` buffers of one partial per chunk, in the compute dtype (fp64 where
    an operand is fp64, else fp32); they follow the operands in the kernel's arguments."""
    block_n, chunks, chunk_blocks = two_pass_chunks(n_cols, operands[1].element_size())
    l2_bytes = 0 if INTERPRET else torch.cuda.get_device_properties(operands[0].device).L2_cache_size
    bytes_per_program = chunk_blocks * TWO_PASS_BLOCK_BYTES * (len(operands) - 1)  # x, or y and dy
    kept_programs = int(l2_bytes * KEPT_L2_FRACTION) // bytes_per_program
    buffers = tuple(Buffer(n_rows * chunks, compute_dtype(*operands)) for _ in range(partials))
    return Recipe(buffers, tuple(
        Step(kernel, n_rows * chunks, (*strides, n_cols, chunks, chunk_blocks, kept_programs),
             dict(CHUNKS_POW2=plans.next_power_of_2(chunks), BLOCK_N=block_n, PHASE=phase.value), TWO_PASS_WARPS)
        for phase in (STATISTICS, FINISH)))

