"""Softmax along the rows at the memory limit, for every row length, forward and backward (notebook 06): which kernel a
call takes and how it is launched. Rows that fit on chip take tiles (``tiles``); longer rows are split among programs
that exchange partials (``split_rows``, ``exchange``) where those programs fit on the GPU together (``residency``);
longer ones still, fp64 rows and rows that span 2**31 elements take two passes (``two_pass``). The shapes come from
``plans``, the launches from ``recipes``."""

from __future__ import annotations

import dataclasses

import torch

from . import exchange, plans, recipes, residency, split_rows, tiles, two_pass
from .device import INTERPRET


def launch_rows_forward(x: torch.Tensor, y: torch.Tensor, plan: plans.Plan | None = None) -> None:
    """Softmax of the rows of the 2-D ``x`` into the contiguous 2-D ``y`` with the fused kernels."""
    recipes.run(forward_recipe, (y, x), plan)


def launch_rows_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, plan: plans.Plan | None = None) -> None:
    """dx of the rows of the 2-D ``y`` and ``dy`` into the contiguous 2-D ``dx`` with the fused kernels."""
    recipes.run(backward_recipe, (dx, y, dy), plan)


def wide_columns(n_cols: int, *tensors: torch.Tensor) -> bool:
    """Whether a row's offsets pass 32 bits in any of ``tensors`` (a dim of a huge tensor taken as rows, its elements
    far apart): tiles and splits compute them in 32 bits, only the two passes in 64."""
    return any((n_cols - 1) * abs(t.stride(1)) >= 2**31 for t in tensors)


def forward_recipe(y: torch.Tensor, x: torch.Tensor, plan: plans.Plan | None) -> recipes.Recipe:
    n_rows, n_cols = x.shape
    ints = (x.stride(0), x.stride(1), y.stride(0), n_rows, n_cols)
    wide = wide_columns(n_cols, x)
    few = (plan is None and x.dtype != torch.float64 and not wide
           and plans.few_rows_plan(n_rows, n_cols, "forward", x.element_size()))
    if few and (recipe := _split_recipe(split_rows.softmax_split_kernel, (y, x), ints, few)) is not None:
        return recipe  # else its pieces do not fit the GPU together: the default plan's may
    planned = plan is None
    plan = plan or plans.plan_for(n_cols, "forward", x.element_size())
    if plan.segments == 1 and not wide:
        if planned:
            plan = plans.spread_tiles(plan, n_rows, residency.sm_count(x.device))
        return _tile_recipe(tiles.softmax_tile_kernel, (y, x), ints, plan)
    if x.dtype != torch.float64 and not wide:  # fp64 partials do not fit a packed word
        recipe = _split_recipe(split_rows.softmax_split_kernel, (y, x), ints, plan, planned)
        if recipe is not None:
            return recipe
    return two_pass.two_pass_recipe(two_pass.softmax_two_pass_kernel, (y, x), ints[:3], n_rows, n_cols, partials=2)


def backward_recipe(dx: torch.Tensor, y: torch.Tensor, dy: torch.Tensor, plan: plans.Plan | None) -> recipes.Recipe:
    n_rows, n_cols = y.shape
    ints = (y.stride(0), y.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), n_rows, n_cols)
    wide = wide_columns(n_cols, y, dy)
    few = (plan is None and torch.float64 not in (y.dtype, dy.dtype) and not wide
           and plans.few_rows_plan(n_rows, n_cols, "backward", y.element_size()))
    if few and (recipe := _split_recipe(split_rows.softmax_backward_split_kernel, (dx, y, dy), ints, few)) is not None:
        return recipe
    planned = plan is None
    plan = plan or plans.plan_for(n_cols, "backward", y.element_size())
    if plan.segments == 1 and not wide:
        if planned:
            plan = plans.spread_tiles(plan, n_rows, residency.sm_count(y.device))
        return _tile_recipe(tiles.softmax_backward_tile_kernel, (dx, y, dy), ints, plan)
    if torch.float64 not in (y.dtype, dy.dtype) and not wide:
        recipe = _split_recipe(split_rows.softmax_backward_split_kernel, (dx, y, dy), ints, plan, planned)
        if recipe is not None:
            return recipe
    return two_pass.two_pass_recipe(two_pass.softmax_backward_two_pass_kernel, (dx, y, dy), ints[:5], n_rows, n_cols,
                                    partials=1)


def _tile_recipe(kernel, operands: tuple[torch.Tensor, ...], ints: tuple, plan: plans.Plan) -> recipes.Recipe:
    n_rows = ints[-2]
    constexprs = dict(ROWS=plan.rows, BLOCK_N=plan.block_n)
    n_tiles = plans.cdiv(n_rows, plan.rows)
    if INTERPRET:
        grid = min(n_tiles, residency.CPU_PROGRAMS)
    elif plan.persistent:
        resources = residency.compiled_resources(kernel, (*operands, *ints), constexprs, plan.num_warps,
                                                 operands[0].device)
        grid = min(n_tiles, resources.resident)
    else:
        grid = n_tiles
    return recipes.Recipe((), (recipes.Step(kernel, grid, ints, constexprs, plan.num_warps),))


def _align(plan: plans.Plan, *tensors: torch.Tensor) -> int:
    """A split's ALIGN: the plan's, when all the tensors have unit column strides, one row stride (so one window fits
    every row of every tensor) and start on 16 bytes, so that a multiple of ALIGN elements from a tensor's start is a
    16-byte boundary in memory for the dtype the plan is made for (32 bytes in an fp32 output of a 16-bit input, 8 in
    a 16-bit gradient of fp32 ones); else 1."""
    row_stride = tensors[0].stride(0)
    fits = all(t.stride(1) == 1 and t.stride(0) == row_stride and _on_16_bytes(t) for t in tensors)
    return plan.align if fits else 1


def _on_16_bytes(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:
        return t.data_ptr() % 16 == 0
    return t.storage_offset() * t.element_size() % 16 == 0  # traced: where it starts in storage (allocations do)


# Even pieces (``plans.piece_length``) that spill this many registers still beat full ones: bf16 rows of 32784 and
# 36880 spill two under the 16-bit forward's cap and run 0.020-0.024 of copy faster (results/README.md, "Even pieces").
EVEN_SPILL_ALLOWANCE = 2
# A split whose groups leave more than 1 - ROW_FILL of the programs the GPU holds idle while rows wait takes narrower
# pieces, if theirs fill it better: fp32 backward rows of 151936 in pieces of 4096 on 8 warps ran 6 groups of 38
# programs where the H100 holds 264 (0.964 of copy), in pieces of 2048 8 groups of 75 of 660 (0.988; results/README.md,
# "Wider pieces"). The plan now gives those pieces 4 warps under a register cap: 10 groups of 38 fill 380 of 396.
ROW_FILL = 0.9


def needs_narrow_pieces(plan: plans.Plan, piece: int, registers: int, spills: int) -> bool:
    """Whether a split of wider pieces than SEGMENT_ELEMENTS, ``piece`` elements of each BLOCK_N, compiled to more
    registers a thread than its plan's cap (else REGISTER_BUDGET), or spilled (as it can with another Triton version,
    or where no register cap reaches the compiler; even pieces, ``piece`` < BLOCK_N, up to EVEN_SPILL_ALLOWANCE
    registers): then it takes narrower pieces (``plans.narrower``)."""
    allowance = EVEN_SPILL_ALLOWANCE if piece < plan.block_n else 0
    budget = plan.max_registers or residency.REGISTER_BUDGET
    return plan.block_n > plans.SEGMENT_ELEMENTS and (registers > budget or spills > allowance)


def _split_recipe(kernel, operands: tuple[torch.Tensor, ...], ints: tuple, plan: plans.Plan,
                  planned: bool = False) -> recipes.Recipe | None:
    """A split, if a row's programs can be resident together (``exchange_recipe``); None if not. Pieces that compile
    over the register budget give way to narrower ones (``needs_narrow_pieces``), and where ``planned`` (``plan`` is
    ``plan_for``'s), so do pieces whose groups leave part of the GPU idle (``ROW_FILL``): of those tried, the launch
    takes the one that fills the GPU best, the widest of equals."""
    n_rows, n_cols = ints[-2:]
    device = operands[0].device
    align = _align(plan, *operands)
    element_size = operands[1].element_size()
    phase = "forward" if kernel is split_rows.softmax_split_kernel else "backward"
    args = (*operands, exchange.PARTIALS, *ints)

    def constexprs_for(plan, even=True):
        piece = plans.piece_length(n_cols, plan, align, element_size, n_rows) if even else plan.block_n
        return dict(SEGMENTS=plan.segments, SEGMENTS_POW2=plans.next_power_of_2(plan.segments), BLOCK_N=plan.block_n,
                    ALIGN=align, PIECE=piece, PHASE=exchange.FUSED.value)

    def compiled(plan):
        """The plan's constexprs and resources, even pieces over the budget replaced by full ones; None if they too
        need narrower pieces."""
        if not recipes.plain(operands):  # traced: torch.compile's Inductor builds the kernel without Triton's maxnreg
            plan = dataclasses.replace(plan, max_registers=None)
        constexprs = constexprs_for(plan)
        resources = residency.compiled_resources(kernel, args, constexprs, plan.num_warps, device, plan.max_registers)
        if constexprs["PIECE"] < plan.block_n and needs_narrow_pieces(plan, constexprs["PIECE"], resources.registers,
                                                                      resources.spills):
            constexprs = constexprs_for(plan, even=False)  # even pieces over the budget: full ones may fit
            resources = residency.compiled_resources(kernel, args, constexprs, plan.num_warps, device,
                                                     plan.max_registers)
        if needs_narrow_pieces(plan, constexprs["PIECE"], resources.registers, resources.spills):
            return None
        return plan, constexprs, resources

    tried = []  # (fill, plan, constexprs, resources) of each plan whose groups fit the GPU
    while plan is not None:
        if residency.split_grid(plan.segments, n_rows, residency.most_resident(plan.num_warps, device)) == 0:
            break  # more pieces than the GPU could ever hold (narrower pieces: more still): no need to compile
        built = compiled(plan)
        if built is not None:
            plan, constexprs, resources = built
            grid = residency.split_grid(plan.segments, n_rows, resources.resident, resources.assured)
            fill = grid / max(min(resources.resident, n_rows * plan.segments), 1)  # all rows at once: full
            if grid:
                tried.append((fill, plan, constexprs, resources))
            if fill >= ROW_FILL or not planned:
                break
        plan = plans.narrower(plan, n_cols, phase, element_size) if planned or built is None else None
    if not tried:
        return None
    _, plan, constexprs, resources = max(tried, key=lambda choice: choice[0])  # the first of equals: the widest
    return exchange.exchange_recipe(kernel, ints, constexprs, plan.num_warps, plan.segments, n_rows, plan.segments,
                                    resources, plan.max_registers, counters=plan.segments)
