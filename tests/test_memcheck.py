"""compute-sanitizer's memcheck over the fused kernels (GPU only): every kernel shape of the benchmark grid, forward and
backward, 16- and 32-bit, contiguous and transposed rows, the column kernels' held and split blocks, and the turned
tiles (fp64 too), must access only memory it owns.

A few rows per shape keep the run short; the shapes, not the row counts, decide which code runs."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ON_GPU

CUDA_SANITIZER = "/usr/local/cuda/bin/compute-sanitizer"
SANITIZER = shutil.which("compute-sanitizer") or (CUDA_SANITIZER if os.path.exists(CUDA_SANITIZER) else None)

ALL_SHAPES = r"""
import torch
import helpers
from helpers import bench, reference

for n in bench.GRID_N:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for transposed in (False, True):
            x = torch.randn((n, 3) if transposed else (3, n), device="cuda").to(dtype) * 4
            x = x.t() if transposed else x
            y = helpers.softmax_forward(x)
            dy = torch.randn_like(y)
            dx = helpers.softmax_backward(y, dy)
            torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=2e-2)
            torch.testing.assert_close(dx.float(), reference.softmax_backward(y.float(), dy.float()), atol=1e-6,
                                       rtol=2e-2)
print("shapes checked:", len(bench.GRID_N) * 3 * 2)
# softmax over another dim: held forward and split backward (700), split both ways (3001: on an H100, 4 rounds of
# column blocks or more, as a forward split needs), odd columns
for shape in ((3, 700, 45), (2, 3001, 2301)):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device="cuda").to(dtype) * 4
        y, dy = helpers.softmax_forward(x, 1), torch.randn_like(x)
        torch.testing.assert_close(y.float(), torch.softmax(x.float(), 1), atol=1e-6, rtol=2e-2)
        torch.testing.assert_close(helpers.softmax_backward(y, dy, 1).float(),
                                   reference.softmax_backward(y.float(), dy.float(), 1), atol=1e-6, rtol=2e-2)
print("other dims checked:", 4)
# turned tiles: channels-last classes (short, and past turned.LONG: not fp64's), a transposed x over its last dim
from helpers import turned
turned_checked = 0
every_dtype, no_fp64 = (torch.float32, torch.bfloat16, torch.float64), (torch.float32, torch.bfloat16)
for shape, dim, layout, dtypes in (((2, 21, 9, 7), 1, "channels_last", every_dtype),
                                   ((1, 2051, 3, 5), 1, "channels_last", no_fp64),
                                   ((301, 37), 1, "transposed", every_dtype)):
    for dtype in dtypes:
        x = torch.randn(shape, device="cuda").to(dtype) * 4
        x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x.t().contiguous().t()
        y = helpers.softmax_forward(x, dim)
        torch.testing.assert_close(y.float(), torch.softmax(x.float(), dim), atol=1e-6, rtol=2e-2)
        y, dy = torch.empty_like(x).copy_(y), torch.randn_like(x)  # y and dy laid out as x, as autograd hands them
        assert turned.takes(dim, x) and turned.takes(dim, y, dy), (shape, layout)
        torch.testing.assert_close(helpers.softmax_backward(y, dy, dim).float(),
                                   reference.softmax_backward(y.float(), dy.float(), dim), atol=1e-6, rtol=2e-2)
        turned_checked += 1
print("turned checked:", turned_checked)
"""


@pytest.mark.skipif(not ON_GPU or SANITIZER is None, reason="needs a GPU and compute-sanitizer")
def test_fused_kernels_memcheck_clean():
    out = subprocess.run([SANITIZER, "--tool", "memcheck", "--error-exitcode", "99", sys.executable, "-c", ALL_SHAPES],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "ERROR SUMMARY: 0 errors" in out.stdout + out.stderr and "shapes checked: 60" in out.stdout, out.stdout
    assert "other dims checked: 4" in out.stdout and "turned checked: 8" in out.stdout, out.stdout
