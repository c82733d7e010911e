"""A dim too long for one column program, split (notebook 07): the programs of a block of columns each hold a piece of
its rows and exchange each column's partials through global memory, as ``split_rows`` does for a long row, so the
data is read once. Short forward pieces merge in two levels: each program merges a few columns' partials into one
final word per column, and every program reads its columns' finals, so a program reads about SEGMENTS + BLOCK_C
words, not SEGMENTS x BLOCK_C, and short pieces of wide runs stay cheap to merge. Long pieces, and the backward, merge
in one level, which measured faster there. ``columns`` chooses when.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .exchange import FINISH, FUSED, MERGE, STATISTICS, pack, read_slots, take_ticket, unpack
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
def merge_partials(m_parts, d_parts, real):
    """Each column's (m, d) from its (m, d) partials along axis 0 (notebook 05's merge); ``real`` marks the partials
    that exist: padding slots take the merge's identity."""
    m_parts = tl.where(real, m_parts, float("-inf"))
    m = tl.max(m_parts, axis=0)
    d = tl.sum(d_parts * tl.exp2((m_parts - tl.where(m == float("-inf"), 0.0, m)[None, :]) * LOG2E), axis=0)
    return m, d


@triton.jit
def merge_column_partials(part_ptr, finals_ptr, group, valid, segment, parity, SEGMENTS: tl.constexpr,
                          SEGMENTS_POW2: tl.constexpr, BLOCK_C: tl.constexpr, JOB_COLUMNS: tl.constexpr):
    """Program ``segment``'s share of column block ``group``'s first level: columns segment, segment + SEGMENTS, ...
    (JOB_COLUMNS of them, those under BLOCK_C; none where SEGMENTS > BLOCK_C and ``segment`` >= BLOCK_C), each
    merged over the group's SEGMENTS partials and published as one final (m, d) word."""
    parts = tl.arange(0, SEGMENTS_POW2)[:, None]
    job = segment + SEGMENTS * tl.arange(0, JOB_COLUMNS)
    in_job = job < tl.where(valid, BLOCK_C, 0)
    slots = part_ptr + (group * SEGMENTS + parts) * BLOCK_C + job[None, :]
    m_parts, d_parts = unpack(read_slots(slots, (parts < SEGMENTS) & in_job[None, :], parity))
    m, d = merge_partials(m_parts, d_parts, parts < SEGMENTS)
    tl.store(finals_ptr + group * BLOCK_C + job, pack(m, d, parity), mask=in_job)


@triton.jit
def softmax_column_split_kernel(y_ptr, x_ptr, part_ptr, n_groups, n_reduced, n_inner, SEGMENTS: tl.constexpr,
                                SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                LEVELS: tl.constexpr, JOB_COLUMNS: tl.constexpr, PHASE: tl.constexpr):
    """Forward for dims too long for one program: SEGMENTS programs share each block of BLOCK_C columns, BLOCK_R rows
    each, and merge each column's (m, d) through ``part_ptr``: the partials, one packed word per column of a piece,
    then the finals, one per column, then the ticket counter, every word tagged with the call's parity. Groups of
    SEGMENTS programs walk the column blocks grid-stride. In one launch (PHASE 2) a program publishes group g's
    partials, then, in two LEVELS, merges its share of group g - 1's into finals (``merge_column_partials``) and
    finishes group g - 2 from its finals, holding three pieces; in one level it finishes group g - 1 from all its
    partials, holding two. Each wait has had an iteration to fill. The interpreter launches STATISTICS, MERGE (two
    levels) and FINISH in turn."""
    finals_ptr = part_ptr + n_groups * SEGMENTS * BLOCK_C
    program, parity, _ = take_ticket(finals_ptr + n_groups * BLOCK_C, PHASE)
    segment = program % SEGMENTS
    first, n_walkers = program // SEGMENTS, tl.num_programs(0) // SEGMENTS
    columns = tl.arange(0, BLOCK_C)
    x_prev = tl.zeros((BLOCK_R, BLOCK_C), x_ptr.dtype.element_ty)
    x_prev2 = tl.zeros((BLOCK_R, BLOCK_C), x_ptr.dtype.element_ty)
    for group_index in range(first, n_groups + LEVELS * n_walkers, n_walkers):  # past the last: it is finished too
        group = tl.cast(group_index, tl.int64)
        valid = group < n_groups
        start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + start + offsets, mask=mask, other=float("-inf"), eviction_policy=KEEP_IN_L2)
        if PHASE == STATISTICS or PHASE == FUSED:
            m = tl.max(upcast(x), axis=0)
            m_finite = tl.where(m == float("-inf"), 0.0, m)
            d = tl.sum(tl.exp2((upcast_again(x) - m_finite[None, :]) * LOG2E), axis=0)
            tl.store(part_ptr + (group * SEGMENTS + segment) * BLOCK_C + columns, pack(m, d, parity),
                     mask=columns < tl.where(valid, BLOCK_C, 0))
        if PHASE == MERGE:
            merge_column_partials(part_ptr, finals_ptr, group, valid, segment, parity, SEGMENTS, SEGMENTS_POW2,
                                  BLOCK_C, JOB_COLUMNS)
        elif PHASE == FINISH:
            finish_column_piece(y_ptr, part_ptr, finals_ptr, group, valid, segment, n_reduced, n_inner, x, parity,
                                SEGMENTS, SEGMENTS_POW2, BLOCK_R, BLOCK_C, LEVELS)
        elif PHASE == FUSED and LEVELS == 2:
            merge_column_partials(part_ptr, finals_ptr, tl.maximum(group - n_walkers, 0),
                                  (group >= first + n_walkers) & (group < n_groups + n_walkers), segment, parity,
                                  SEGMENTS, SEGMENTS_POW2, BLOCK_C, JOB_COLUMNS)
            finish_column_piece(y_ptr, part_ptr, finals_ptr, tl.maximum(group - 2 * n_walkers, 0),
                                group >= first + 2 * n_walkers, segment, n_reduced, n_inner, x_prev2, parity,
                                SEGMENTS, SEGMENTS_POW2, BLOCK_R, BLOCK_C, LEVELS)
            x_prev2, x_prev = x_prev, x
        elif PHASE == FUSED:
            finish_column_piece(y_ptr, part_ptr, finals_ptr, tl.maximum(group - n_walkers, 0),
                                group >= first + n_walkers, segment, n_reduced, n_inner, x_prev, parity, SEGMENTS,
                                SEGMENTS_POW2, BLOCK_R, BLOCK_C, LEVELS)
            x_prev = x


@triton.jit
def finish_column_piece(y_ptr, part_ptr, finals_ptr, group, valid, segment, n_reduced, n_inner, x, parity,
                        SEGMENTS: tl.constexpr, SEGMENTS_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr, LEVELS: tl.constexpr):
    """y = exp(x - m) / d for one piece of column block ``group``, kept as loaded: each column's (m, d) from its final
    (two LEVELS), or merged from all SEGMENTS of its partials (one)."""
    columns = tl.arange(0, BLOCK_C)
    if LEVELS == 2:
        m, d = unpack(read_slots(finals_ptr + group * BLOCK_C + columns, columns < tl.where(valid, BLOCK_C, 0), parity))
    else:
        parts = tl.arange(0, SEGMENTS_POW2)[:, None]
        slots = part_ptr + (group * SEGMENTS + parts) * BLOCK_C + columns[None, :]
        m_parts, d_parts = unpack(read_slots(slots, parts < tl.where(valid, SEGMENTS, 0), parity))
        m, d = merge_partials(m_parts, d_parts, parts < SEGMENTS)
    m = tl.where(m == float("-inf"), 0.0, m)
    start, offsets, mask = column_piece(group, segment, n_reduced, n_inner, valid, BLOCK_R, BLOCK_C)
    tl.store(y_ptr + start + offsets, tl.exp2((upcast_again(x) - m[None, :]) * LOG2E) * (1.0 / d)[None, :], mask=mask)


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
    """Backward of ``softmax_column_split_kernel``, merged in one level: the programs of a column block exchange each
    column's part of sum(y * dy), and each program reads all SEGMENTS x BLOCK_C of its group's, one group behind
    (holding two pieces of y and dy where the forward's pipeline would hold three: that measured slower)."""
    program, parity, _ = take_ticket(part_ptr + n_groups * SEGMENTS * BLOCK_C, PHASE)
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
