"""Softmax over a dim that is not the last, without moving it there (notebook 07).

A contiguous tensor is seen as (outer, R, inner): softmax runs along R, whose elements lie ``inner`` apart in memory.
Each program owns BLOCK_C neighbouring columns of one outer index and holds their whole length (BLOCK_R, R's next
power of two) in registers, so it reads its input once and writes its output once, in the input's own layout: no
transpose copy, and the output comes out contiguous, as torch's does. Neighbouring columns are neighbours in memory,
so each of a program's R rows is one contiguous run of BLOCK_C elements. A dim too long to hold is split among
programs that exchange each column's partials, as ``fused``'s split rows do, or, where those programs would not fit
the GPU together (or would not pay for their exchange: ``SplitLaunch.pays``) and in fp64, taken in two
launches as ``two_pass`` takes rows: chunks of its rows reduced to
partials, then merged and finished (notebook 05's online softmax, down the columns). Notebook 09's column exercise is
the small version of these kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import exchange, plans, recipes, residency
from .column_split import (
    column_piece,
    merge_partials,
    softmax_backward_column_split_kernel,
    softmax_column_split_kernel,
)
from .exchange import FINISH, STATISTICS
from .kernels import compute_dtype, upcast
from .tiles import KEEP_IN_L2, LOG2E

# A forward block is WIDE_COLUMNS wide, or NARROW_COLUMNS from LONG_COLUMN rows on, in any dtype: it computes in fp32,
# so its registers go by elements. Each row of a backward block is a run of WIDE_RUN_BYTES, or NARROW_RUN_BYTES from
# LONG_COLUMN rows on. A warp per WARP_BYTES the block holds (both inputs of the backward), 2 to 16. A program holds
# dims up to MAX_HELD elements (forward) or MAX_HELD_BACKWARD (y and dy). A dim whose columns beside it (inner: the
# heads of attention pooling, xyz), rounded up to a power of two, are fewer than MIN_COLUMNS (so 8 or fewer) takes
# blocks as narrow as its columns, and pieces (below) as much taller, so a block holds its elements without idle
# lanes: a held one as many as the longest held block (``held_length``). The measurements behind these numbers and
# the pieces below: results/README.md.
WIDE_COLUMNS = 64
NARROW_COLUMNS = 32
WIDE_RUN_BYTES = 256
NARROW_RUN_BYTES = 64
LONG_COLUMN = 512
MIN_COLUMNS = 16
MAX_HELD = 1024
MAX_HELD_BACKWARD = 512
TURNED_MAX_HELD_FP64 = 1024  # fp64 dims up to this long are left to turned tiles (``turned``)
WARP_BYTES = 8192
# A longer dim is split: the programs of a column block hold a piece of its rows each and exchange each column's
# partials, so the data is read once. Pieces of (rows, bytes of columns, warps), tried in turn: a launch takes the
# first whose group of pieces the GPU holds together (``split_plans``). An fp32 forward takes short pieces of
# 128-byte runs merged in two levels while a dim has at most MAX_TWO_LEVEL_PIECES of them (held three at a time; no
# 16-bit piece merged in two levels beat FORWARD_PIECE). The backward takes pieces of 128-byte runs, short ones while a
# dim has at most MAX_BACKWARD_PIECES of them (their one-level merge of SEGMENTS x BLOCK_C partials would outgrow the
# registers past that), tall ones up to MAX_TALL_PIECES (as many as an H100 holds at one program an SM),
# LONG_BACKWARD_PIECE, of 64-byte runs, where neither fits, and LONGEST_BACKWARD_PIECE, of 32-byte runs, where the
# GPU does not hold a group of long ones.
FORWARD_PIECE = (2048, 32, 16)
TWO_LEVEL_PIECE = (256, 128, 4)
MAX_TWO_LEVEL_PIECES = 128
BACKWARD_PIECE = (128, 128, 4)
MAX_BACKWARD_PIECES = 64
TALL_BACKWARD_PIECE = (256, 128, 8)
MAX_TALL_PIECES = 128
LONG_BACKWARD_PIECE = (512, 64, 8)
LONGEST_BACKWARD_PIECE = (1024, 32, 8)
# A dim too long to hold whose split does not fit the GPU together, and an fp64 one (whose partials do not fit the
# split's packed words), takes two launches in which no program waits for another (``two_pass``'s, down the columns):
# 3 transfers for the forward's 2, 5 for the backward's 3. Its programs walk chunks of a column block's rows, a block of
# TWO_PASS_PIECE (rows, bytes of columns, warps) at a time: one block a chunk, or as many as keep a column block to
# MAX_COLUMN_CHUNKS chunks, whose partials a FINISH program merges at once.
TWO_PASS_PIECE = (128, 128, 4)
MAX_COLUMN_CHUNKS = 128
# A split that runs fewer than MIN_FILL of the programs the GPU holds (or of its pieces, where there are fewer) gives
# way to the next plan that fills more: one group of 79 tall pieces leaves 53 of an H100's 132 SMs idle, where long
# pieces run three groups of 40.
MIN_FILL = 2 / 3
# A split pays for its exchange only where it keeps the GPU busy. A forward one that runs under FULL_FILL of the
# programs the GPU holds, or whose column blocks take fewer than FORWARD_MIN_ROUNDS rounds of the groups that run at
# once, takes two passes instead (dim 0 of (100000, 64) fp32: 0.485 of copy against 0.346). A backward one is taken
# wherever it fits, but for pieces of 32-byte runs (LONGEST_BACKWARD_PIECE, across full-width blocks) that run under
# FULL_FILL through more than LONGEST_MAX_ROUNDS rounds: 98 of them leave a quarter of an H100 idle, round after round,
# where two passes fill it (dim 0 of (100000, 512) fp32: 0.53 of copy against 0.42). Both rules: results/README.md,
# "Over few columns".
FULL_FILL = 0.9
FORWARD_MIN_ROUNDS = 4
LONGEST_MAX_ROUNDS = 8


@dataclass(frozen=True)
class ColumnPlan:
    block_r: int
    block_c: int
    num_warps: int
    segments: int = 1  # programs that share a block of columns, BLOCK_R rows each
    levels: int = 1  # of a split's merge (``column_split.softmax_column_split_kernel``)


def column_plan(n_reduced: int, n_inner: int, element_size: int, n_inputs: int = 1) -> ColumnPlan:
    """The block of a column program for a dim of ``n_reduced`` elements ``n_inner`` apart, reading ``n_inputs``
    tensors (1: forward, 2: backward): held whole up to MAX_HELD (or MAX_HELD_BACKWARD) elements, split among
    programs past that, in the first of ``split_plans`` (on a GPU, the first whose programs fit it together, else
    in two passes: ``_recipe``). Symbolic sizes (torch.compile's dynamic shapes) are made concrete, as in
    ``plans.plan_for``."""
    n_reduced, n_inner = int(n_reduced), int(n_inner)
    if n_reduced > held_length(n_inner, element_size, n_inputs):
        return split_plans(n_reduced, element_size, n_inputs, n_inner)[0]
    return _held_plan(n_reduced, n_inner, element_size, n_inputs)


def held_length(n_inner: int, element_size: int, n_inputs: int) -> int:
    """The longest dim a program holds whole, over ``n_inner`` columns: MAX_HELD (MAX_HELD_BACKWARD for y and dy),
    or where fewer than MIN_COLUMNS columns narrow the block, as many elements as the longest held block, MAX_HELD x
    NARROW_COLUMNS (MAX_HELD_BACKWARD x NARROW_RUN_BYTES of each input)."""
    if not _narrowed(n_inner):
        return MAX_HELD if n_inputs == 1 else MAX_HELD_BACKWARD
    block_c = plans.next_power_of_2(n_inner)
    if n_inputs == 1:
        return MAX_HELD * NARROW_COLUMNS // block_c
    return MAX_HELD_BACKWARD * (NARROW_RUN_BYTES // element_size) // block_c


def split_plans(n_reduced: int, element_size: int, n_inputs: int, n_inner: int = MIN_COLUMNS) -> list[ColumnPlan]:
    """The plans of a split of a dim of ``n_reduced`` elements over ``n_inner`` columns, best first: each piece while
    it cuts the dim into at most its count of pieces, and the last piece of each direction at any length. Over fewer
    columns than a piece's run holds (and fewer than MIN_COLUMNS), the piece is as narrow as the columns and as much
    taller. A symbolic size is made concrete, as in ``column_plan``."""
    n_reduced = int(n_reduced)
    if n_inputs == 1:
        pieces = [(TWO_LEVEL_PIECE, MAX_TWO_LEVEL_PIECES, 2)] if element_size == 4 else []
        pieces.append((FORWARD_PIECE, None, 1))
    else:
        pieces = [(BACKWARD_PIECE, MAX_BACKWARD_PIECES, 1), (TALL_BACKWARD_PIECE, MAX_TALL_PIECES, 1),
                  (LONG_BACKWARD_PIECE, None, 1), (LONGEST_BACKWARD_PIECE, None, 1)]
    split = []
    for piece, most, levels in pieces:
        block_r, block_c, warps = _piece_block(piece, element_size, n_inner)
        plan = ColumnPlan(block_r, block_c, warps, segments=plans.cdiv(n_reduced, block_r), levels=levels)
        if (most is None or plan.segments <= most) and plan not in split:  # over narrow columns, long and longest meet
            split.append(plan)
    return split


def _piece_block(piece: tuple[int, int, int], element_size: int, n_inner: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of a block of ``piece`` (rows, bytes of columns, warps): over fewer columns than its run
    holds (and fewer than MIN_COLUMNS), as narrow as the columns and as much taller."""
    rows, run_bytes, warps = piece
    run = run_bytes // element_size
    block_c = min(run, plans.next_power_of_2(int(n_inner))) if _narrowed(n_inner) else run
    return rows * run // block_c, block_c, warps


def _narrowed(n_inner: int) -> bool:
    """Whether ``n_inner`` columns, fewer than MIN_COLUMNS, narrow a block to their own width."""
    return plans.next_power_of_2(int(n_inner)) < MIN_COLUMNS


def _held_plan(n_reduced: int, n_inner: int, element_size: int, n_inputs: int) -> ColumnPlan:
    """A block that holds the whole dim, no wider than its columns."""
    block_r = plans.next_power_of_2(n_reduced)
    if n_inputs == 1:
        columns = NARROW_COLUMNS if block_r >= LONG_COLUMN else WIDE_COLUMNS
    else:
        columns = (NARROW_RUN_BYTES if block_r >= LONG_COLUMN else WIDE_RUN_BYTES) // element_size
    block_c = min(columns, plans.next_power_of_2(n_inner))
    warps = plans.next_power_of_2(max(1, block_r * block_c * element_size * n_inputs // WARP_BYTES))
    return ColumnPlan(block_r, block_c, num_warps=min(16, max(2, warps)))


def takes_columns(dim: int, *tensors: torch.Tensor) -> bool:
    """Whether softmax over ``dim`` of these contiguous tensors runs down their columns, here: a dim that is not the
    last and has neighbours (inner > 1: otherwise it is a contiguous row), whose elements for one outer index number
    under 2**31 (the kernels' offsets are 32-bit), and in fp64 (if any is) longer than turned tiles hold."""
    t = tensors[0]
    if not (0 <= dim < t.ndim - 1 and all(u.is_contiguous() for u in tensors)):
        return False
    _, n_reduced, n_inner = _sizes(t, dim)
    short_fp64 = n_reduced <= TURNED_MAX_HELD_FP64 and any(u.dtype == torch.float64 for u in tensors)
    return n_inner > 1 and n_reduced * n_inner < 2**31 and not short_fp64


def _sizes(t: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """(outer, R, inner) of a contiguous ``t`` around ``dim``."""
    outer, inner = 1, 1
    for size in t.shape[:dim]:
        outer *= size
    for size in t.shape[dim + 1:]:
        inner *= size
    return outer, t.shape[dim], inner


@triton.jit
def softmax_column_kernel(y_ptr, x_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Forward: each column's max m and denominator d down its R elements, then y = exp(x - m) / d. A program's block
    is where ``column_piece`` puts the one piece (segment 0) of column block ``pid``."""
    start, offsets, mask = column_piece(tl.program_id(0).to(tl.int64), 0, n_reduced, n_inner, True, BLOCK_R, BLOCK_C)
    x = upcast(tl.load(x_ptr + start + offsets, mask=mask, other=float("-inf"), eviction_policy=KEEP_IN_L2))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a column of -inf: exp gives 0s, and 0 / 0 the NaNs torch gives
    e = tl.exp2((x - m[None, :]) * LOG2E)
    d = tl.sum(e, axis=0)
    tl.store(y_ptr + start + offsets, e * (1.0 / d)[None, :], mask=mask)


@triton.jit
def softmax_backward_column_kernel(dx_ptr, y_ptr, dy_ptr, n_reduced, n_inner, BLOCK_R: tl.constexpr,
                                   BLOCK_C: tl.constexpr):
    """Backward: dx = y * (dy - sum(y * dy)), the sum down each column."""
    start, offsets, mask = column_piece(tl.program_id(0).to(tl.int64), 0, n_reduced, n_inner, True, BLOCK_R, BLOCK_C)
    y = upcast(tl.load(y_ptr + start + offsets, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + start + offsets, mask=mask, other=0.0))
    s = tl.sum(y * dy, axis=0)
    tl.store(dx_ptr + start + offsets, y * (dy - s[None, :]), mask=mask)


@triton.jit
def column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R: tl.constexpr):
    """Offsets and mask of the BLOCK_R rows from ``start`` of a two-pass program's columns ``c``."""
    r = start + tl.arange(0, BLOCK_R)[:, None]
    return base + r * n_inner + c[None, :], (r < n_reduced) & (c[None, :] < n_inner)


@triton.jit
def block_columns(group, n_reduced, n_inner, BLOCK_C: tl.constexpr):
    """The 64-bit start of column block ``group``'s outer index, and the block's columns."""
    blocks = tl.cdiv(n_inner, BLOCK_C)
    return group.to(tl.int64) // blocks * n_reduced * n_inner, group % blocks * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def column_statistics(x_ptr, base, c, first, end, n_reduced, n_inner, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each column's running (m, d) over rows ``first`` to ``end``, BLOCK_R at a time (notebook 05's online softmax,
    down the columns), in the compute dtype (fp64 for fp64)."""
    m = upcast(tl.full((BLOCK_C,), float("-inf"), x_ptr.dtype.element_ty))
    d = tl.zeros_like(m)
    for start in range(first, end, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((x - m_safe[None, :]) * LOG2E), axis=0)
        m = m_new
    return m, d


@triton.jit
def column_finish(y_ptr, x_ptr, base, c, first, end, n_reduced, n_inner, m, d, BLOCK_R: tl.constexpr):
    """y = exp(x - m) / d over rows ``first`` to ``end``, from the last block (what STATISTICS read last, L2 holds
    first)."""
    m = tl.where(m == float("-inf"), 0.0, m)  # a column of -inf: exp gives 0s, and 0 / 0 the NaNs torch gives
    d_inverse = 1.0 / d
    steps = tl.cdiv(end - first, BLOCK_R)
    for step in range(steps):
        offsets, mask = column_chunk(base, first + (steps - 1 - step) * BLOCK_R, c, n_reduced, n_inner, BLOCK_R)
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")))
        tl.store(y_ptr + offsets, tl.exp2((x - m[None, :]) * LOG2E) * d_inverse[None, :], mask=mask)


@triton.jit
def column_dot(y_ptr, dy_ptr, base, c, first, end, n_reduced, n_inner, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """Each column's sum of y * dy over rows ``first`` to ``end``, in the compute dtype (fp64 if either is)."""
    zeros = tl.zeros((BLOCK_C,), tl.float32)
    s = upcast(zeros.to(y_ptr.dtype.element_ty)) * upcast(zeros.to(dy_ptr.dtype.element_ty))
    for start in range(first, end, BLOCK_R):
        offsets, mask = column_chunk(base, start, c, n_reduced, n_inner, BLOCK_R)
        y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
        s += tl.sum(y * upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0)), axis=0)
    return s


@triton.jit
def column_backward_finish(dx_ptr, y_ptr, dy_ptr, base, c, first, end, n_reduced, n_inner, s,
                           BLOCK_R: tl.constexpr):
    """dx = y * (dy - s) over rows ``first`` to ``end``, from the last block."""
    steps = tl.cdiv(end - first, BLOCK_R)
    for step in range(steps):
        offsets, mask = column_chunk(base, first + (steps - 1 - step) * BLOCK_R, c, n_reduced, n_inner, BLOCK_R)
        y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        tl.store(dx_ptr + offsets, y * (dy - s[None, :]), mask=mask)


@triton.jit
def chunk_of(n_reduced, n_inner, chunks, chunk_rows, PHASE: tl.constexpr, BLOCK_C: tl.constexpr):
    """A two-pass program's chunk: its place (FINISH counts from the last, to re-read first what STATISTICS read
    last), its block's start and columns, and its rows ``first`` to ``end``."""
    program = tl.program_id(0)
    if PHASE == FINISH:
        program = tl.num_programs(0) - 1 - program
    base, c = block_columns(program // chunks, n_reduced, n_inner, BLOCK_C)
    first = program % chunks * chunk_rows
    return program, base, c, first, tl.minimum(first + chunk_rows, n_reduced)


@triton.jit
def softmax_column_two_pass_kernel(y_ptr, x_ptr, m_ptr, d_ptr, n_reduced, n_inner, chunks, chunk_rows,
                                   CHUNKS_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                   PHASE: tl.constexpr):
    """Forward in two launches in which no program waits for another (``two_pass``'s, down the columns): ``chunks``
    programs share a column block, each walking ``chunk_rows`` of its rows. STATISTICS stores each column's (m, d)
    over the chunk; FINISH merges the block's partials and writes y over the chunk, reading x again."""
    program, base, c, first, end = chunk_of(n_reduced, n_inner, chunks, chunk_rows, PHASE, BLOCK_C)
    columns = tl.arange(0, BLOCK_C)
    if PHASE == STATISTICS:
        m, d = column_statistics(x_ptr, base, c, first, end, n_reduced, n_inner, BLOCK_R, BLOCK_C)
        tl.store(m_ptr + program * BLOCK_C + columns, m)
        tl.store(d_ptr + program * BLOCK_C + columns, d)
    else:
        parts = tl.arange(0, CHUNKS_POW2)[:, None]
        slots = (program // chunks * chunks + parts) * BLOCK_C + columns[None, :]
        real = parts < chunks
        m, d = merge_partials(tl.load(m_ptr + slots, mask=real, other=float("-inf")),
                              tl.load(d_ptr + slots, mask=real, other=0.0), real)
        column_finish(y_ptr, x_ptr, base, c, first, end, n_reduced, n_inner, m, d, BLOCK_R)


@triton.jit
def softmax_backward_column_two_pass_kernel(dx_ptr, y_ptr, dy_ptr, s_ptr, n_reduced, n_inner, chunks, chunk_rows,
                                            CHUNKS_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                            PHASE: tl.constexpr):
    """Backward in two launches: STATISTICS stores each column's sum of y * dy over the chunk, FINISH adds up the
    block's sums and writes dx = y * (dy - sum) over the chunk."""
    program, base, c, first, end = chunk_of(n_reduced, n_inner, chunks, chunk_rows, PHASE, BLOCK_C)
    columns = tl.arange(0, BLOCK_C)
    if PHASE == STATISTICS:
        s = column_dot(y_ptr, dy_ptr, base, c, first, end, n_reduced, n_inner, BLOCK_R, BLOCK_C)
        tl.store(s_ptr + program * BLOCK_C + columns, s)
    else:
        parts = tl.arange(0, CHUNKS_POW2)[:, None]
        slots = (program // chunks * chunks + parts) * BLOCK_C + columns[None, :]
        s = tl.sum(tl.load(s_ptr + slots, mask=parts < chunks, other=0.0), axis=0)
        column_backward_finish(dx_ptr, y_ptr, dy_ptr, base, c, first, end, n_reduced, n_inner, s, BLOCK_R)


def _recipe(kernels: tuple, operands: tuple[torch.Tensor, ...], dim: int) -> recipes.Recipe:
    """The launch of ``kernels`` (held, split, two-pass) on ``operands`` (output first): in two passes where an input
    is fp64, else as ``column_plan`` says. A split takes the first of ``split_plans`` whose programs fit the GPU
    together, whose pieces span under 2**31 elements (their offsets are 32-bit) and which fills at least MIN_FILL of
    the GPU, else the first that fits; a split that does not pay (``SplitLaunch.pays``) takes two passes; where none
    fits, the dim is held (up to a forward's ``held_length``), else taken in two passes."""
    held, split, two_passes = kernels
    n_outer, n_reduced, n_inner = _sizes(operands[0], dim)
    inputs = operands[1:]
    if any(t.dtype == torch.float64 for t in inputs):
        return _two_pass_recipe(two_passes, operands, n_outer, n_reduced, n_inner)
    element_size = max(t.element_size() for t in inputs)
    plan = column_plan(n_reduced, n_inner, element_size, len(inputs))
    if plan.segments > 1:
        chosen = None
        for candidate in split_plans(n_reduced, element_size, len(inputs), n_inner):
            found = _split_recipe(split, operands, candidate, n_outer, n_reduced, n_inner)
            if found and found.fill >= MIN_FILL:
                chosen = found
                break
            chosen = chosen or found
        if chosen and chosen.pays():
            return chosen.recipe
    if plan.segments > 1 and n_reduced > held_length(n_inner, element_size, 1):
        return _two_pass_recipe(two_passes, operands, n_outer, n_reduced, n_inner)
    if plan.segments > 1:
        plan = _held_plan(n_reduced, n_inner, inputs[0].element_size(), len(inputs))
    grid = n_outer * plans.cdiv(n_inner, plan.block_c)
    return recipes.Recipe((), (recipes.Step(held, grid, (n_reduced, n_inner), dict(BLOCK_R=plan.block_r,
                                                                                BLOCK_C=plan.block_c),
                                        plan.num_warps),))


@dataclass(frozen=True)
class SplitLaunch:
    recipe: recipes.Recipe
    fill: float  # the share of the programs the GPU holds (or of the pieces, where there are fewer) that it runs
    rounds: float  # column blocks over the groups that run at once
    backward: bool
    short_runs: bool  # pieces of LONGEST_BACKWARD_PIECE's runs, across blocks as wide as a run

    def pays(self) -> bool:
        """Whether the split beats two passes here: a forward one keeps FULL_FILL of the GPU busy through
        FORWARD_MIN_ROUNDS rounds or more; a backward one of short runs keeps FULL_FILL busy, or takes at most
        LONGEST_MAX_ROUNDS rounds."""
        if self.backward:
            return not self.short_runs or self.fill >= FULL_FILL or self.rounds <= LONGEST_MAX_ROUNDS
        return self.fill >= FULL_FILL and self.rounds >= FORWARD_MIN_ROUNDS


def _split_recipe(split, operands: tuple[torch.Tensor, ...], plan: ColumnPlan, n_outer: int, n_reduced: int,
                  n_inner: int) -> SplitLaunch | None:
    """The launch of the ``split`` kernel in ``plan``, with the share of the GPU it fills and its rounds, or None where
    its programs do not fit the GPU together or a piece spans 2**31 elements."""
    if plan.block_r * n_inner >= 2**31:
        return None
    n_groups = n_outer * plans.cdiv(n_inner, plan.block_c)
    ints = (n_groups, n_reduced, n_inner)
    constexprs = dict(SEGMENTS=plan.segments, SEGMENTS_POW2=plans.next_power_of_2(plan.segments),
                      BLOCK_R=plan.block_r, BLOCK_C=plan.block_c, PHASE=exchange.FUSED.value)
    group_slots, interpreted = plan.segments * plan.block_c, (exchange.STATISTICS, exchange.FINISH)
    if len(operands) == 2:  # the forward: room for finals; in two levels each program merges JOB_COLUMNS columns
        constexprs.update(LEVELS=plan.levels,
                          JOB_COLUMNS=plans.next_power_of_2(plans.cdiv(plan.block_c, plan.segments)))
        group_slots += plan.block_c
        if plan.levels == 2:
            interpreted = (exchange.STATISTICS, exchange.MERGE, exchange.FINISH)
    device = operands[0].device
    if not residency.split_grid(plan.segments, n_groups, residency.most_resident(plan.num_warps, device)):
        return None  # more pieces than the GPU could ever hold: no need to compile the split to know
    resources = residency.compiled_resources(split, (*operands, exchange.PARTIALS, *ints), constexprs, plan.num_warps,
                                             device)
    recipe = exchange.exchange_recipe(split, ints, constexprs, plan.num_warps, plan.segments, n_groups, group_slots,
                                      resources, interpreted=interpreted)
    if recipe is None:
        return None
    running = residency.split_grid(plan.segments, n_groups, resources.resident, resources.assured)
    element_size = max(t.element_size() for t in operands[1:])
    short_runs = plan.block_c * element_size <= LONGEST_BACKWARD_PIECE[1] and not _narrowed(n_inner)
    return SplitLaunch(recipe, running / min(resources.resident, plan.segments * n_groups),
                       n_groups / (running // plan.segments), backward=len(operands) == 3, short_runs=short_runs)


def _two_pass_recipe(kernel, operands: tuple[torch.Tensor, ...], n_outer: int, n_reduced: int,
                     n_inner: int) -> recipes.Recipe:
    """STATISTICS then FINISH of a two-pass ``kernel`` on ``operands`` (output first), in blocks of TWO_PASS_PIECE and
    chunks of rows (MAX_COLUMN_CHUNKS); its partial buffers, (m, d) forward or sum(y * dy) backward, a word per column
    of each chunk, follow the operands."""
    block_r, block_c, warps = _piece_block(TWO_PASS_PIECE, max(t.element_size() for t in operands[1:]), n_inner)
    chunk_rows = block_r * plans.cdiv(plans.cdiv(n_reduced, block_r), MAX_COLUMN_CHUNKS)
    chunks = plans.cdiv(n_reduced, chunk_rows)
    n_programs = n_outer * plans.cdiv(n_inner, block_c) * chunks
    partials = recipes.Buffer(n_programs * block_c, compute_dtype(*operands))
    constexprs = dict(CHUNKS_POW2=plans.next_power_of_2(chunks), BLOCK_R=block_r, BLOCK_C=block_c)
    return recipes.Recipe((partials,) * (1 if len(operands) == 3 else 2), tuple(
        recipes.Step(kernel, n_programs, (n_reduced, n_inner, chunks, chunk_rows), dict(constexprs, PHASE=phase.value),
                     warps) for phase in (STATISTICS, FINISH)))


def in_two_passes(operands: tuple[torch.Tensor, ...], dim: int) -> bool:
    """Whether the column launch on ``operands`` (y and x, or dx, y and dy) takes two passes (``_recipe``)."""
    build = forward_recipe if len(operands) == 2 else backward_recipe
    kernel = recipes.recipe_for(build, operands, dim).steps[0].kernel
    return kernel in (softmax_column_two_pass_kernel, softmax_backward_column_two_pass_kernel)


def forward_recipe(y: torch.Tensor, x: torch.Tensor, dim: int) -> recipes.Recipe:
    return _recipe((softmax_column_kernel, softmax_column_split_kernel, softmax_column_two_pass_kernel), (y, x), dim)


def backward_recipe(dx: torch.Tensor, y: torch.Tensor, dy: torch.Tensor, dim: int) -> recipes.Recipe:
    return _recipe((softmax_backward_column_kernel, softmax_backward_column_split_kernel,
                    softmax_backward_column_two_pass_kernel), (dx, y, dy), dim)


def launch_columns_forward(x: torch.Tensor, y: torch.Tensor, dim: int) -> None:
    """y = softmax(x, dim) for contiguous x and y (``takes_columns``)."""
    recipes.run(forward_recipe, (y, x), dim)


def launch_columns_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, dim: int) -> None:
    """dx from y and dy, all contiguous (``takes_columns``)."""
    recipes.run(backward_recipe, (dx, y, dy), dim)
