"""Where the course's kernels run, decided once, before triton is imported.

Order of preference: a CUDA GPU (ROCm GPUs show up as CUDA too), an Ascend NPU (when ``torch_npu`` imports), else the
CPU through Triton's interpreter. The interpreter is switched on by ``TRITON_INTERPRET=1``, which Triton reads when it
is imported, so this module must run before the first ``import triton``.

``SOFTMAX_INTERPRET`` overrides the choice: ``1`` forces the interpreter on CPU tensors even on a GPU machine; ``0``
refuses it, for the cross-compilation check that builds GPU code on a machine without a GPU.

``TRITON_DEFAULT_FP_FUSION`` is set to ``1`` where unset: FMA contraction stays on in Triton 3.10 as in 3.9.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

OVERRIDE_VARIABLE = "SOFTMAX_INTERPRET"


def _accelerator() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return None
    return "npu" if torch.npu.is_available() else None


def _select() -> tuple[torch.device, bool]:
    override = os.environ.get(OVERRIDE_VARIABLE, "").strip()
    if override not in ("", "0", "1"):
        raise ValueError(f"{OVERRIDE_VARIABLE} must be 0 or 1, not {override!r}")
    accelerator = None if override == "1" else _accelerator()
    if accelerator is not None:
        return torch.device(accelerator), False
    return torch.device("cpu"), override != "0"


DEVICE, INTERPRET = _select()

if INTERPRET:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError(
            "triton was imported before helpers, so Triton's interpreter is off and kernels cannot run on this CPU.\n"
            "Fix: restart the kernel (or the Python process) and put `import helpers` before any `import triton`.\n"
            "(helpers sets TRITON_INTERPRET=1, which Triton reads only when it is first imported.)"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    # A row of all -inf computes -inf - (-inf) in numpy, which warns with a site-packages path on every such row.
    # The NaN it makes is the answer torch gives too, so the warning is noise for a learner.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

# Whether Triton contracts a * b + c into one FMA instruction: on by default up to Triton 3.9, which warns (once a
# process) that 3.10 turns it off. The course's kernels and recorded numbers were made with it on; a learner's own
# setting wins. Triton reads the variable at each compile, so setting it here, after its import, still counts.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def sized(gpu, cpu):
    """The GPU size on a GPU, the small CPU size under the interpreter (about 1 ms per program there)."""
    return cpu if INTERPRET else gpu


# The odd shape every kernel is checked on: neither side a power of two.
ODD_SHAPE = sized(gpu=(1823, 781), cpu=(67, 181))


def describe() -> str:
    """One line saying where kernels run, for the top of every notebook."""
    if DEVICE.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(DEVICE)} (torch {torch.__version__})"
    if DEVICE.type == "npu":
        return f"Ascend NPU (torch {torch.__version__})"
    mode = "Triton interpreter" if INTERPRET else "compile-only (interpreter disabled)"
    return f"CPU, {mode} (torch {torch.__version__}): small sizes, no timings"
