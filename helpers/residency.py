"""How many programs of a compiled kernel the GPU holds at once, and so how many programs a group that waits for
its own members may launch (``split_grid``)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .device import INTERPRET


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def resident_programs(compiled, num_warps: int, device: int) -> int:
    """How many programs of a compiled kernel the whole GPU holds at once, as the CUDA driver's occupancy calculator
    counts them from its registers, threads and shared memory (with their allocation granularities and the shared
    memory each program reserves: a count of our own once came out one program per SM too high)."""
    compiled._init_handles()  # loads the binary, which fills in the function handle
    per_sm = ctypes.c_int()
    status = _cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(per_sm), ctypes.c_void_p(compiled.function), ctypes.c_int(32 * num_warps),
        ctypes.c_size_t(compiled.metadata.shared))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm.value


@dataclass(frozen=True)
class Resources:
    """What a compiled kernel takes: registers per thread, spilled registers, programs resident on the GPU, and of
    those the programs it would hold whatever registers a build of the kernel took (``assured_resident``; 0 under the
    interpreter, where only ``resident`` counts)."""

    registers: int
    spills: int
    resident: int
    assured: int = 0


CPU_PROGRAMS = 4  # under the interpreter: a small persistent grid, so every kernel's loop runs several times
# Triton's interpreter counts as a GPU that holds this many programs, so that on CPU long rows take the two-pass
# kernels as a small GPU would
CPU_RESIDENT_PROGRAMS = 64
# ... and as a GPU of this many SMs, so that a small call spreads its tiles (``plans.spread_tiles``) as on a GPU
CPU_SMS = 4
REGISTER_BUDGET = 128  # per thread: 16 one-warp programs (8 two-warp ones) fit an SM's 65536 registers
# An SM's registers (65536 on every NVIDIA GPU since compute capability 3.0), and the most a thread can take (255),
# as they are allocated (a warp's in units of 256): at that most an SM still holds 8 warps.
REGISTERS_PER_SM = 65536
MOST_REGISTERS = 256
_resources_cache: dict[tuple, Resources] = {}


def sm_count(device: torch.device) -> int:
    """The SMs of ``device``'s GPU (CPU_SMS under the interpreter)."""
    if INTERPRET:
        return CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def compile_options(num_warps: int, max_registers: int | None) -> dict:
    """Triton's launch options for programs of ``num_warps`` warps within ``max_registers`` registers a thread."""
    return dict(num_warps=num_warps) if max_registers is None else dict(num_warps=num_warps, maxnreg=max_registers)


def compiled_resources(kernel, args, constexprs, num_warps: int, device: torch.device,
                       max_registers: int | None = None) -> Resources:
    """The registers, spills and residency of ``kernel`` as compiled for these arguments (within ``max_registers`` a
    thread, if given), read off the compiled kernel on the GPU: they change with the Triton version (a piece of 141
    registers on one, 128 on another)."""
    if INTERPRET:
        return Resources(0, 0, CPU_RESIDENT_PROGRAMS)
    # Compiled for the dtypes alone (no data pointers: under torch.compile the tensors are FakeTensors), with the
    # integers' specialisations (== 1, multiple of 16) kept: a unit column stride changes the code the most.
    signature = [a.dtype if isinstance(a, torch.Tensor) else a if isinstance(a, torch.dtype) else int(a) for a in args]
    key = (kernel.fn.__name__, num_warps, max_registers, device.index, *sorted(constexprs.items()),
           *(a if isinstance(a, torch.dtype) else (a == 1, a % 16 == 0) for a in signature))
    if key not in _resources_cache:
        compiled = kernel.warmup(*signature, **constexprs, grid=(1,), **compile_options(num_warps, max_registers))
        resident = resident_programs(compiled, num_warps, device.index or 0)
        assured = min(resident, assured_resident(num_warps, device))
        _resources_cache[key] = Resources(compiled.n_regs, compiled.n_spills, resident, assured)
    return _resources_cache[key]


def assured_resident(num_warps: int, device: torch.device) -> int:
    """The programs of ``num_warps`` warps the GPU holds at once however many registers a build of them takes: an SM
    holds 8 warps at a thread's most registers (a program of more warps gets fewer a thread, and one still fits), and
    no more threads than it can run. On an H100, 132 programs of 8 warps, 264 of 4. (``compiled_resources`` keeps
    the least of this and the compiled kernel's own count, which also counts its shared memory.)"""
    properties = torch.cuda.get_device_properties(device)
    by_registers = max(1, REGISTERS_PER_SM // (32 * num_warps * MOST_REGISTERS))
    by_threads = properties.max_threads_per_multi_processor // (32 * num_warps)
    return properties.multi_processor_count * min(by_registers, by_threads)


def most_resident(num_warps: int, device: torch.device) -> int:
    """The most programs of ``num_warps`` warps the GPU can hold at once, whatever they take of registers and shared
    memory: its threads per SM (2048 on an H100, 1024 on a T4) over a program's, times its SMs."""
    if INTERPRET:
        return CPU_RESIDENT_PROGRAMS
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count * (properties.max_threads_per_multi_processor // (32 * num_warps))


# A split waits only for programs that are resident beside it, with room to spare: the kernel a launch runs can be
# built with more registers than the one counted (another alignment, torch.compile's own build).
RESIDENCY_MARGIN = 2


def split_grid(segments: int, n_rows: int, resident: int, assured: int = 0) -> int:
    """Programs to launch for a split of ``segments`` programs per row on a GPU that holds ``resident`` of them at once:
    whole groups of a row's programs, at most one group per row and no more than the GPU holds. 0 when a group fits
    neither RESIDENCY_MARGIN times over nor within the ``assured`` programs the GPU holds whatever the build's
    registers (``assured_resident``): those rows take the two-pass kernels. A wait is then always for a program that
    is running or can start (programs take their place in start order, ``take_ticket``, so the first to start form
    whole groups, which finish and make room for the rest)."""
    if segments > max(resident // RESIDENCY_MARGIN, assured):
        return 0
    return segments * min(n_rows, resident // segments)


def spill_report() -> list[dict]:
    """Registers and spills of every variant of the fused and column kernels compiled in this process."""
    from . import column_split, columns, split_rows, tiles, two_pass

    rows = []
    for kernel in (tiles.softmax_tile_kernel, split_rows.softmax_split_kernel, tiles.softmax_backward_tile_kernel,
                   split_rows.softmax_backward_split_kernel, two_pass.softmax_two_pass_kernel,
                   two_pass.softmax_backward_two_pass_kernel, columns.softmax_column_kernel,
                   columns.softmax_backward_column_kernel, column_split.softmax_column_split_kernel,
                   column_split.softmax_backward_column_split_kernel, columns.softmax_column_two_pass_kernel,
                   columns.softmax_backward_column_two_pass_kernel):
        for compiled in kernel.device_caches[torch.cuda.current_device()][0].values():
            compiled._init_handles()
            constants = {k[0] if isinstance(k, tuple) else k: v for k, v in compiled.src.constants.items()}
            rows.append(dict(kernel=kernel.fn.__name__, n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                             num_warps=compiled.metadata.num_warps, constants=str(constants)))
    return rows
