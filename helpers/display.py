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
