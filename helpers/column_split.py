"""A dim too long for one column program, split (notebook 07): the programs of a block of columns each hold a piece of
its rows and exchange each column's partials through global memory, as ``split_rows`` does for a long row, so the
data is read once. ``columns`` chooses when.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .exchange import FINISH, FUSED, pack, read_slots, take_ticket, unpack
from .kernels import upcast
from .tiles import KEEP_IN_L2, LOG2E, upcast_again


@triton.jit
def column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Where piece ``segment`` of column block ``group`` (its BLOCK_C columns of one outer index) lies: rows
    segment * BLOCK_R on, BLOCK_R of them, as a 64-bit start and 32-bit offsets from it (fewer registers than 64-bit
    offsets; ``columns._recipe`` keeps BLOCK_R * n_inner under 2**31), and their mask. Nothing of a group past the
    end (not ``valid``)."""
    blocks = tl.cdiv(n_inner, BLOCK_C)
    outer, block = group // blocks, (group % blocks).to(tl.int32)
    r = tl.arange(0, BLOCK_R)[:, None]
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    start = (outer * n_reduced + segment * BLOCK_R) * n_inner
    return start, r * n_inner + c, (r < tl.where(valid, n_reduced - segment * BLOCK_R, 0)) & (c < n_inner)


@triton.jit
def finish_column_piece(y_ptr, part_ptr, group, valid, segment, n_reduced, n_inner, x, parity,
                        SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """y for one piece of column block ``group``, kept as loaded: merge each column's SEGMENTS (m, d) partials, then
    y = exp(x - m) / d."""
    parts = tl.arange(0, SEGMENTS_POW2)[:, None]
    slots = part_ptr + (group * SEGMENTS + parts) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    m_parts, d_parts = unpack(read_slots(slots, parts < tl.where(valid, SEGMENTS, 0), parity))
    m_parts = tl.where(parts < SEGMENTS, m_parts, float("-inf"))  # padding slots: the merge identity
    m = tl.max(m_parts, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    d_inverse = 1.0 / tl.sum(d_parts * tl.exp2((m_parts - m[None, :]) * LOG2E), axis=0)
    start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
    tl.store(y_ptr + start + offsets, tl.exp2((upcast_again(x) - m[None, :]) * LOG2E) * d_inverse[None, :], mask=mask)


@triton.jit
def softmax_column_split_kernel(y_ptr, x_ptr, part_ptr, n_groups, n_reduced, n_inner, SEGMENTS: tl.constexpr,
                                SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                PHASE: tl.constexpr):
    """Forward for dims too long for one program: SEGMENTS programs share each block of BLOCK_C columns, BLOCK_R rows
    each, and merge each column's (m, d) through ``part_ptr``, as ``split_rows.softmax_split_kernel`` merges a row's:
    one packed word per column of a piece, tagged with the call's parity, and a ticket counter after the last group's.
    Groups of SEGMENTS programs walk the column blocks grid-stride, finishing each one iteration behind."""
    program, parity = take_ticket(part_ptr + n_groups * SEGMENTS * BLOCK_C, PHASE)
    segment = program % SEGMENTS
    first, n_walkers = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    columns = tl.arange(0, BLOCK_C)
    x_prev = tl.zeros((BLOCK_R, BLOCK_C), x_ptr.dtype.element_ty)
    for group_index in range(first, n_groups + n_walkers, n_walkers):
        group = tl.cast(group_index, tl.int64)
        valid = group < n_groups
        start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + start + offsets, mask=mask, other=float("-inf"), eviction_policy=KEEP_IN_L2)
        if PHASE != FINISH:
            m = tl.max(upcast(x), axis=0)
            m_finite = tl.where(m == float("-inf"), 0.0, m)
            d = tl.sum(tl.exp2((upcast_again(x) - m_finite[None, :]) * LOG2E), axis=0)
            tl.store(part_ptr + (group * SEGMENTS + segment) * BLOCK_C + columns, pack(m, d, parity),
                     mask=columns < tl.where(valid, BLOCK_C, 0))
        if PHASE == FUSED:
            finish_column_piece(y_ptr, part_ptr, tl.maximum(group - n_walkers, 0), group >= first + n_walkers,
                                segment, n_reduced, n_inner, x_prev, parity, SEGMENTS, SEGMENTS_POW2, BLOCK_R,
                                BLOCK_C)
            x_prev = x
        elif PHASE == FINISH:
            finish_column_piece(y_ptr, part_ptr, group, valid, segment, n_reduced, n_inner, x, parity, SEGMENTS,
                                SEGMENTS_POW2, BLOCK_R, BLOCK_C)


@triton.jit
def finish_backward_column_piece(dx_ptr, part_ptr, group, valid, segment, n_reduced, n_inner, y, dy, parity,
                                 SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
    """dx for one piece of column block ``group``: each column's sum(y * dy) from its partials, then y * (dy - sum)."""
    parts = tl.arange(0, SEGMENTS_POW2)[:, None]
    slots = part_ptr + (group * SEGMENTS + parts) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    dot_parts, _ = unpack(read_slots(slots, parts < tl.where(valid, SEGMENTS, 0), parity))
    dot = tl.sum(tl.where(parts < SEGMENTS, dot_parts, 0.0), axis=0)
    start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
    tl.store(dx_ptr + start + offsets, upcast_again(y) * (upcast_again(dy) - dot[None, :]), mask=mask)


@triton.jit
def softmax_backward_column_split_kernel(dx_ptr, y_ptr, dy_ptr, part_ptr, n_groups, n_reduced, n_inner,
                                         SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
                                         BLOCK_C: tl.constexpr, PHASE: tl.constexpr):
    """Backward of ``softmax_column_split_kernel``: the programs of a column block exchange each column's part of
    sum(y * dy)."""
    program, parity = take_ticket(part_ptr + n_groups * SEGMENTS * BLOCK_C, PHASE)
    segment = program % SEGMENTS
    first, n_walkers = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    columns = tl.arange(0, BLOCK_C)
    y_prev = tl.zeros((BLOCK_R, BLOCK_C), y_ptr.dtype.element_ty)
    dy_prev = tl.zeros((BLOCK_R, BLOCK_C), dy_ptr.dtype.element_ty)
    for group_index in range(first, n_groups + n_walkers, n_walkers):
        group = tl.cast(group_index, tl.int64)
        valid = group < n_groups
        start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
        y = tl.load(y_ptr + start + offsets, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
        dy = tl.load(dy_ptr + start + offsets, mask=mask, other=0.0, eviction_policy=KEEP_IN_L2)
        if PHASE != FINISH:
            dot = tl.sum(upcast(y) * upcast(dy), axis=0)
            tl.store(part_ptr + (group * SEGMENTS + segment) * BLOCK_C + columns, pack(dot, tl.zeros_like(dot), parity),
                     mask=columns < tl.where(valid, BLOCK_C, 0))
        if PHASE == FUSED:
            finish_backward_column_piece(dx_ptr, part_ptr, tl.maximum(group - n_walkers, 0),
                                         group >= first + n_walkers, segment, n_reduced, n_inner, y_prev, dy_prev,
                                         parity, SEGMENTS, SEGMENTS_POW2, BLOCK_R, BLOCK_C)
            y_prev, dy_prev = y, dy
        elif PHASE == FINISH:
            finish_backward_column_piece(dx_ptr, part_ptr, group, valid, segment, n_reduced, n_inner, y, dy, parity,
                                         SEGMENTS, SEGMENTS_POW2, BLOCK_R, BLOCK_C)
