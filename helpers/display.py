"""Showing the course's real code in notebooks: the kernel a learner reads is the kernel that runs."""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path


def source_of(obj: object) -> str:
    """The source text of a function, class or Triton kernel (a ``@triton.jit`` object wraps the function)."""
    target = getattr(obj, "fn", obj)  # JITFunction and the interpreter's wrapper keep the Python function in .fn
    return inspect.getsource(target)


def show_source(obj: object) -> None:
    """Display ``obj``'s source as a highlighted code block (plain text outside a notebook)."""
    text = source_of(obj)
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    display(Markdown(f"```python\n{text}```"))


def kernel_operations(kernel: object, ops: tuple[str, ...] = ("exp", "max", "sum")) -> dict[str, int]:
    """How many times a kernel's source calls each ``tl.<op>(``: exponentials and row reductions, counted from the
    real source so a comparison stays true when the kernel changes."""
    source = source_of(kernel)
    return {op: source.count(f"tl.{op}(") for op in ops}


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What NVIDIA's ``cuobjdump`` (shipped with Triton) prints for a compiled kernel's binary: ``-sass`` for its
    machine code, ``-res-usage`` for its registers and stack."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool, *flags, file.name], capture_output=True, text=True, check=True).stdout


def instruction_mix(kernel: object, signature: dict, constexprs: dict, num_warps: int = 1, arch: int = 90) -> Counter:
    """The machine instructions (SASS opcodes, without modifiers) that a small self-contained kernel compiles to for
    an NVIDIA GPU of compute capability ``arch``: a cross-compilation, so it runs without a GPU, interpreter on or not.
    ``signature`` gives each argument's type ("*fp32", "fp32", "i32") and "constexpr" for those in ``constexprs``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(triton.runtime.JITFunction(getattr(kernel, "fn", kernel)), signature, constexprs)
    # fusion off: the instructions shown are the ones the source writes, whatever Triton's default
    options = dict(num_warps=num_warps, enable_fp_fusion=False)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    # instruction lines look like "/*0070*/  @!P0 FMUL R4, R4, 0.5 ;": the opcode follows the address and predicate
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return Counter(opcodes)
