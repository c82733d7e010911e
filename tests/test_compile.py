"""Every Triton kernel in helpers (teaching and fused) compiles for a free-Colab T4 (sm_75) and an H100 (sm_90),
with no GPU present.

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
CONSTEXPRS = {"ROWS": 4, "SEGMENTS": 5, "SEGMENTS_POW2": 8, "PHASE": helpers.fused.FUSED}  # others: block sizes
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
    print(name)
'''


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("arch", [75, 90], ids=["sm_75-T4", "sm_90-H100"])
def test_kernels_compile(arch, dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SOFTMAX_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(arch), dtype], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = out.stdout.split()
    assert "softmax_kernel" in compiled and "softmax_split_kernel" in compiled
