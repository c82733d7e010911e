"""Every Triton kernel in helpers (teaching and fused) compiles for a free-Colab T4 (sm_75) and an H100 (sm_90),
with no GPU present, and the split kernels stay within the registers their occupancy was tuned for.

The compilation runs in a subprocess with the interpreter off (SOFTMAX_INTERPRET=0), since an interpreted kernel
cannot be compiled.
"""

import os
import subprocess
import sys

import pytest


def compile_in_subprocess(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python with the interpreter off; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SOFTMAX_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


COMPILE_ALL = r'''
import sys
import helpers, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

arch, dtype = int(sys.argv[1]), sys.argv[2]
modules = (helpers.kernels, helpers.tiles, helpers.split_rows, helpers.two_pass, helpers.columns)
kernels = {name: obj for module in modules
           for name, obj in vars(module).items()
           if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")}
assert len(kernels) >= 17, sorted(kernels)
# others: blocks (PIECE under its block: even pieces; LEVELS: the column split's two-level merge)
CONSTEXPRS = {"ROWS": 4, "SEGMENTS": 5, "SEGMENTS_POW2": 8, "ALIGN": 4, "CHUNKS_POW2": 512, "BLOCK_R": 256,
              "BLOCK_C": 16, "LEVELS": 2, "JOB_COLUMNS": 4, "PIECE": 1000}
PARTIALS = {"part_ptr": "*i64", "m_ptr": "*fp32", "d_ptr": "*fp32", "dot_ptr": "*fp32"}  # fp64's in fp64
for name, kernel in sorted(kernels.items()):
    # fp64 rows too long for a tile take the two-pass kernels, and fp64 softmax over another dim the rows path
    if dtype == "fp64" and ("split" in name or "column" in name):
        continue
    phases = (0, 1) if "two_pass" in name else (2,)  # the two-pass kernels run STATISTICS, then FINISH
    for phase in phases if "PHASE" in kernel.arg_names else (None,):
        signature, constexprs = {}, {}
        for param in kernel.params:
            if param.is_constexpr:
                value = phase if param.name == "PHASE" else CONSTEXPRS.get(param.name, 1024)
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif param.name in PARTIALS:
                fp64_partials = dtype == "fp64" and param.name != "part_ptr"
                signature[param.name] = "*fp64" if fp64_partials else PARTIALS[param.name]
            else:
                signature[param.name] = f"*{dtype}" if param.name.endswith("_ptr") else "i32"
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["cubin"], name
        ptx = compiled.asm["ptx"]
        # exponentials with tl.exp's guard for subnormal results (ex2 without .ftz), and without it
        print(f"{name}:{phase}", ptx.count("ex2.approx.f32"), ptx.count("ex2.approx.ftz.f32"))
'''


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("arch", [75, 90], ids=["sm_75-T4", "sm_90-H100"])
def test_kernels_compile(arch, dtype):
    out = compile_in_subprocess(COMPILE_ALL, str(arch), dtype)
    exponentials = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in out.stdout.splitlines()}
    assert "softmax_kernel:None" in exponentials and "softmax_two_pass_kernel:1" in exponentials, exponentials
    if dtype == "fp64":  # fp64 exponentials are libdevice calls, not the hardware's ex2
        return
    assert "softmax_split_kernel:2" in exponentials
    # notebook 06: the fused forward kernels' exponentials skip tl.exp's subnormal guard; notebook 01's keep it
    assert exponentials["softmax_kernel:None"][0] > 0, exponentials
    for name in ("softmax_tile_kernel:None", "softmax_split_kernel:2", "softmax_two_pass_kernel:0",
                 "softmax_two_pass_kernel:1"):
        guarded, plain = exponentials[name]
        assert guarded == 0 and plain > 0, (name, exponentials[name])


AS_LAUNCHED_ON_H100 = r"""
import re
import helpers, triton
from helpers.display import cuobjdump
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from helpers import exchange, fused, plans, residency, split_rows, tiles


# kernel compiled for sm_90 as launched on contiguous rows (16-byte aligned data pointers, unit column strides; the
# other integers specialised as multiples of 16 where they are), with its registers and stack bytes
def compile_as_launched(kernel, dtype, constexprs, num_warps, ints_multiple_of_16=False, max_registers=None):
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, param in enumerate(kernel.params):
        if param.name in constexprs:
            signature[param.name] = "constexpr"
        elif param.name.endswith("col_stride"):
            signature[param.name], constexprs[param.name] = "constexpr", 1
        elif param.name.endswith("_ptr"):
            signature[param.name] = "*i64" if param.name == "part_ptr" else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "i32"
            if ints_multiple_of_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=residency.compile_options(num_warps, max_registers))
    usage = cuobjdump(compiled.asm["cubin"], "-res-usage")
    return compiled, int(usage.split("REG:")[1].split()[0]), int(usage.split("STACK:")[1].split()[0])
"""

SPLIT_KERNELS = AS_LAUNCHED_ON_H100 + r"""
for phase, kernel in (("forward", split_rows.softmax_split_kernel),
                      ("backward", split_rows.softmax_backward_split_kernel)):
    for dtype, element_size in (("bf16", 2), ("fp32", 4)):
        # odd row strides: 16-bit pieces of 8192 would not come out full at 50257 and 131083; at 200019 they do,
        # leaving padding (the 16-bit backward: 4 warps under WIDE_BACKWARD_REGISTERS, even shares)
        for n_cols in (50257, 131083, 200019):
            for align in (1, plans.plan_for(n_cols, phase, element_size).align):
                plan = plans.plan_for(n_cols, phase, element_size)
                # the launcher's rule: even pieces over the register budget fall back to full ones, wide pieces to
                # narrow ones
                pieces = [plans.piece_length(n_cols, plan, align, element_size), plan.block_n]
                while True:
                    constexprs = dict(SEGMENTS=plan.segments, SEGMENTS_POW2=triton.next_power_of_2(plan.segments),
                                      BLOCK_N=plan.block_n, PIECE=pieces.pop(0), PHASE=exchange.FUSED.value,
                                      ALIGN=align)
                    compiled, registers, stack = compile_as_launched(kernel, dtype, constexprs, plan.num_warps,
                                                                     max_registers=plan.max_registers)
                    spills = stack // 4  # 4-byte registers
                    if not fused.needs_narrow_pieces(plan, constexprs["PIECE"], registers, spills):
                        break
                    if not pieces or pieces[0] == constexprs["PIECE"]:
                        plan = plans.narrower(plan, n_cols, phase, element_size)
                        pieces = [plans.piece_length(n_cols, plan, align, element_size)]
                wide_loads = len(re.findall(r"ld\.global(?:\.[\w:]+)*\.v4", compiled.asm["ptx"]))
                budget = plan.max_registers or residency.REGISTER_BUDGET
                print(phase, dtype, n_cols, plan.block_n, constexprs["PIECE"], align, registers, stack, wide_loads,
                      budget)
"""


def test_split_kernels_compile_to_wide_loads_within_registers():
    """Rows of an odd length start off 16-byte boundaries. ALIGN > 1 cuts them so the pieces still load 16 bytes per
    instruction (ALIGN = 1: none do), and the pieces the launcher runs stay within 128 registers a thread (the
    backward's pieces of 16 KB within their cap of 168, three programs of 4 warps an SM) without spilling, so 16
    one-warp programs (8 two-warp, 4 four-warp ones) fit an SM: the split kernels' speed rests on both. Register
    allocation changes between Triton versions, so the launcher reads the compiled kernel's registers
    and gives pieces wider than 2048 over the budget narrower ones (``plans.narrower``; unaligned: all); this test
    applies the same rule, and the plan's register cap (the 16-bit forward's, the wide backward's), to the compiler it
    runs with, after even pieces over the budget fall back to full ones. 16-bit pieces fit only because they stay
    16-bit until used (``upcast_again``; an fp32 copy takes 145-210 registers)."""
    out = compile_in_subprocess(SPLIT_KERNELS)
    compiled = [line.split() for line in out.stdout.splitlines()]
    assert len(compiled) == 24, out.stdout
    assert "2048" in {block_n for *_, block_n, _, _, _, _, _, _ in compiled}, out.stdout
    assert any(piece != block_n for *_, block_n, piece, _, _, _, _, _ in compiled), out.stdout  # even pieces at 50257
    for *_, align, registers, stack, wide_loads, budget in compiled:
        if align == "1":
            assert wide_loads == "0", out.stdout
        else:
            assert int(wide_loads) > 0 and int(registers) <= int(budget) and stack == "0", out.stdout


WIDEST_BACKWARD_TILE = AS_LAUNCHED_ON_H100 + r"""
for dtype, element_size in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
    plan = plans.plan_for(32768, "backward", element_size)
    # the whole-row tile for every case; n_rows, n_cols and the row strides are multiples of 16
    _, _, stack = compile_as_launched(tiles.softmax_backward_tile_kernel, dtype, dict(ROWS=1, BLOCK_N=32768),
                                      plans.tile_plan(32768).num_warps, ints_multiple_of_16=True)
    print(dtype, plan.segments, stack)
"""


def test_widest_backward_tile_is_planned_only_where_it_does_not_spill():
    """A backward row of 32768 is one whole-row tile in 16 bits and split in fp32 (plan_for), because only the 16-bit
    tile fits in registers: no stack (spilled registers) for it, a stack for fp32's. Without ``upcast_again`` the
    16-bit tile spills too."""
    out = compile_in_subprocess(WIDEST_BACKWARD_TILE)
    lines = map(str.split, out.stdout.splitlines())
    compiled = {case: (int(segments), int(stack)) for case, segments, stack in lines}
    assert compiled["bf16"] == compiled["fp16"] == (1, 0), out.stdout
    segments, stack = compiled["fp32"]
    assert segments > 1 and stack > 0, out.stdout


ONE_ROW_KERNEL = AS_LAUNCHED_ON_H100 + r"""
from helpers import kernels

for n_cols in (16384, 65536):
    for dtype in ("fp32", "bf16"):
        block = triton.next_power_of_2(n_cols)
        _, registers, stack = compile_as_launched(kernels.softmax_kernel, dtype, dict(BLOCK_SIZE=block),
                                                  kernels.num_warps_for(block))
        print(n_cols, dtype, registers, stack)
"""


def test_one_row_kernel_spills_at_65536():
    """Notebook 01's kernel, on the warps its launcher gives: a row of 16384 fits in registers; one of 65536 (128
    values a thread on 16 warps, and 128 registers a thread at most) spills to the stack, as notebooks 01 and 05
    say where it slows."""
    out = compile_in_subprocess(ONE_ROW_KERNEL)
    compiled = {(int(n), dtype): (int(registers), int(stack)) for n, dtype, registers, stack in
                map(str.split, out.stdout.splitlines())}
    for dtype in ("fp32", "bf16"):
        assert compiled[16384, dtype][1] == 0, out.stdout
        registers, stack = compiled[65536, dtype]
        assert registers == 128 and stack > 0, out.stdout
