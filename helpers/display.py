"""Showing the course's real code in notebooks: the kernel a learner reads is the kernel that runs."""

from __future__ import annotations

import inspect


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
