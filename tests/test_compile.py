"""Every Triton kernel in helpers (teaching and fused) compiles for a free-Colab T4 (sm_75) and an H100 (sm_90),
with no GPU present, and the split kernels stay within the registers their occupancy was tuned for.

The compilation runs in a subprocess with the interpreter off (SOFTMAX_INTERPRET=0), since an interpreted kernel
cannot be compiled.
"""

import os
import subprocess
import sys

import pytest

COMPILE_ALL = r'''
import sys
import helpers, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

arch, dtype = int(sys.argv[1]), sys.argv[2]
kernels = {name: obj for module in (helpers.kernels, helpers.fused) for name, obj in vars(module).items()
           if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")}
assert len(kernels) >= 9, sorted(kernels)
CONSTEXPRS = {"ROWS": 4, "SEGMENTS": 5, "SEGMENTS_POW2": 8, "ALIGN": 4, "PHASE": helpers.fused.FUSED}  # others: blocks
for name, kernel in sorted(kernels.items()):
    signature, constexprs = {}, {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", CONSTEXPRS.get(param.name, 1024)
        elif param.name == "part_ptr":  # packed partials of the split kernels
            signature[param.name] = "*i64"
        else:
            signature[param.name] = f"*{dtype}" if param.name.endswith("_ptr") else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"], name
    ptx = compiled.asm["ptx"]
    # exponentials with tl.exp's guard for subnormal results (ex2 without .ftz), and without it
    print(name, ptx.count("ex2.approx.f32"), ptx.count("ex2.approx.ftz.f32"))
'''


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("arch", [75, 90], ids=["sm_75-T4", "sm_90-H100"])
def test_kernels_compile(arch, dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SOFTMAX_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(arch), dtype], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    exponentials = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in out.stdout.splitlines()}
    assert "softmax_kernel" in exponentials and "softmax_split_kernel" in exponentials
    if dtype == "fp64":  # fp64 exponentials are libdevice calls, not the hardware's ex2
        return
    # notebook 06: the fused forward kernels' exponentials skip tl.exp's subnormal guard; notebook 01's keep it
    assert exponentials["softmax_kernel"][0] > 0, exponentials
    for name in ("softmax_tile_kernel", "softmax_split_kernel"):
        guarded, plain = exponentials[name]
        assert guarded == 0 and plain > 0, (name, exponentials[name])


SPLIT_KERNELS = r"""
import re
import helpers, triton
from helpers.display import cuobjdump
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

fused = helpers.fused
cases = [(fused.softmax_split_kernel, "bf16", 2), (fused.softmax_split_kernel, "fp32", 4),
         (fused.softmax_backward_split_kernel, "bf16", 4)]
for kernel, dtype, warps in cases:
    for align in (1, 8 if dtype == "bf16" else 4):
        # as launched on rows of 50257: contiguous, 16-byte aligned data pointers, an odd row stride
        signature, attrs = {}, {}
        constexprs = dict(SEGMENTS=25, SEGMENTS_POW2=32, BLOCK_N=fused.SEGMENT_ELEMENTS, PHASE=fused.FUSED, ALIGN=align)
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
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        usage = cuobjdump(compiled.asm["cubin"], "-res-usage")
        registers = int(usage.split("REG:")[1].split()[0])
        wide_loads = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", compiled.asm["ptx"]))
        print(kernel.fn.__name__, dtype, warps, align, registers, wide_loads)
"""


def test_split_kernels_compile_to_wide_loads_within_registers():
    """Rows of an odd length (50257) start off 16-byte boundaries. ALIGN > 1 cuts them so the pieces still load 16
    bytes per instruction (ALIGN = 1: none do), and the aligned kernels stay within 128 registers a thread, so 8
    two-warp programs (4 four-warp ones) fit an SM: the split kernels' speed rests on both. (A 64-bit program index
    once pushed the 16-bit forward past 200 registers.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SOFTMAX_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", SPLIT_KERNELS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = [line.split() for line in out.stdout.splitlines()]
    assert len(compiled) == 6, out.stdout
    for _name, _dtype, _warps, align, registers, wide_loads in compiled:
        if align == "1":
            assert wide_loads == "0", out.stdout
        else:
            assert int(wide_loads) > 0 and int(registers) <= 128, out.stdout
