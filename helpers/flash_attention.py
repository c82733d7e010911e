"""Attention, softmax(Q K^T * scale) V, without ever storing the scores: FlashAttention-2 in Triton.

Row i of the scores is a softmax row that arrives one key block at a time. The online softmax of notebook 05 keeps
its running max ``m`` and denominator ``d``; here it also keeps the unnormalised output ``o``, rescaled by
exp(m_old - m_new) like ``d`` whenever the max rises. The forward saves only O and the row log-sum-exp ``L``, from
which the backward recomputes each block of P. Shapes are (batch, heads, seq, head_dim), any strides; ``causal`` masks
key j > query i (top-left aligned, as ``scaled_dot_product_attention(is_causal=True)``).

Backward (per row, with dP = dO V^T): dS = P * (dP - delta), delta = rowsum(dO * O) = rowsum(P * dP);
dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO. One kernel per key block writes dK, dV; one per query block
writes dQ: every output has one writer, so no atomics.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import INTERPRET
from .kernels import launch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)  # powers of two up to one tile wide
LOG2E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)): the kernels work in base 2 (ex2 is one GPU instruction)
LOWEST_FP32 = tl.constexpr(torch.finfo(torch.float32).min)  # where the forward's running max starts


class Blocks(NamedTuple):
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


# (BLOCK_M, BLOCK_N, warps, stages) by kernel and head_dim (<= 64, 128). 16-bit: bench_attention.best_tiles of the
# H100's tuning run (`python -m helpers.bench_attention --tune`: results/*-attention-tuning.csv, bf16, batch 4,
# 16 heads, seq 4096): the least time over causal and full among the candidates that spill no register. fp32 dots:
# exact, on FMA units.
GPU_BLOCKS = {
    "16-bit": {("forward", 64): Blocks(128, 64, 8, 3), ("forward", 128): Blocks(64, 64, 4, 3),
               ("dkdv", 64): Blocks(64, 64, 4, 3), ("dkdv", 128): Blocks(32, 64, 4, 3),
               ("dq", 64): Blocks(128, 64, 8, 3), ("dq", 128): Blocks(128, 64, 8, 3)},
    "fp32": {("forward", 64): Blocks(64, 32, 8, 2), ("forward", 128): Blocks(64, 32, 16, 2),
             ("dkdv", 64): Blocks(16, 32, 8, 2), ("dkdv", 128): Blocks(16, 32, 8, 2),
             ("dq", 64): Blocks(32, 32, 8, 2), ("dq", 128): Blocks(32, 32, 8, 2)},
}
INTERPRETER_BLOCKS = Blocks(32, 32, 1, 1)  # the interpreter takes ~15 ms a loop step, at any tile size
DELTA_BLOCK_M = 32 if INTERPRET else 64  # rows per program of the backward's preprocess (delta)


def blocks_for(kernel: str, head_dim: int, dtype: torch.dtype) -> Blocks:
    """The tiles, warps and pipeline stages of ``kernel`` ("forward", "dkdv", "dq") for this head_dim and dtype."""
    if INTERPRET:
        return INTERPRETER_BLOCKS
    return GPU_BLOCKS["fp32" if dtype == torch.float32 else "16-bit"][kernel, 64 if head_dim <= 64 else 128]


@triton.jit
def _indices(start, SIZE: tl.constexpr, WIDE: tl.constexpr):
    """start, start + 1, ..., start + SIZE - 1: in 64 bits where a tensor's offsets within a head may pass 2**31
    elements (``wide_offsets``), so that an index times a stride does not wrap; else in 32, which address faster."""
    indices = start + tl.arange(0, SIZE)
    if WIDE:
        indices = indices.to(tl.int64)
    return indices


@triton.jit
def _forward_blocks(o, d, m, q, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows, lo, hi, seq_k,
                    qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, WIDE: tl.constexpr):
    """Merge key blocks [lo, hi) into a query tile's running (m, d, o). MASKED: blocks the diagonal crosses and the
    ragged last one; the others need no mask on the scores."""
    dims = _indices(0, HEAD_DIM, WIDE)
    for start_n in range(lo, hi, BLOCK_N):
        cols = _indices(start_n, BLOCK_N, WIDE)
        kT_ptrs = k_base + cols[None, :] * k_stride_s + dims[:, None] * k_stride_d  # K^T tile: (HEAD_DIM, BLOCK_N)
        v_ptrs = v_base + cols[:, None] * v_stride_s + dims[None, :] * v_stride_d
        if MASKED:  # only a ragged last block reads past the end
            kT = tl.load(kT_ptrs, mask=cols[None, :] < seq_k, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < seq_k, other=0.0)
        else:
            kT, v = tl.load(kT_ptrs), tl.load(v_ptrs)
        qk = tl.dot(q, kT, input_precision="ieee")  # the scores are qk * qk_scale, in base 2
        if MASKED:  # scaled, then masked: a masked -inf times a qk_scale of 0 would be NaN
            keep = cols[None, :] < seq_k  # keys past the end, and (causal) after the query
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
        else:  # qk_scale >= 0 (attention_forward turns a negative one round): the max of qk, scaled, is the scores'
            m_new = tl.maximum(m, tl.max(qk, axis=1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one multiply-add a score before the exp
        alpha = tl.math.exp2(m - m_new)  # rescales what was summed under the old max
        d = d * alpha + tl.sum(p, axis=1)
        o = tl.dot(p.to(v.dtype), v, o * alpha[:, None], input_precision="ieee")
        m = m_new
    return o, d, m


@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr,  # inputs (batch, heads, seq, head_dim), any strides
    o_ptr,  # output: q's shape and dtype
    L_ptr,  # row log-sum-exp in base 2 (log2 sum_j 2^(s_ij)), fp32, contiguous (batch, heads, seq_q)
    q_stride_b, q_stride_h, q_stride_s, q_stride_d, k_stride_b, k_stride_h, k_stride_s, k_stride_d,
    v_stride_b, v_stride_h, v_stride_s, v_stride_d, o_stride_b, o_stride_h, o_stride_s, o_stride_d,
    n_heads, seq_q, seq_k,
    qk_scale,  # scale * log2(e): softmax(scale * QK^T) = normalised exp2(qk_scale * QK^T)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr,
):
    """One program per (query tile, batch * head): O and L in one pass over the keys."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64: it would widen every score
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    batch, head = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)  # 64-bit: large tensors' offsets
    rows, dims = _indices(start_m, BLOCK_M, WIDE), _indices(0, HEAD_DIM, WIDE)
    q_base = q_ptr + batch * q_stride_b + head * q_stride_h
    q = tl.load(q_base + rows[:, None] * q_stride_s + dims[None, :] * q_stride_d, mask=rows[:, None] < seq_q, other=0.0)
    k_base, v_base = k_ptr + batch * k_stride_b + head * k_stride_h, v_ptr + batch * v_stride_b + head * v_stride_h
    # m starts at the lowest finite fp32, not -inf: m_new is then finite even where a row's first scores all are -inf
    # (keys of -inf, or products past fp32's range), so p = exp2(-inf) = 0 there, where -inf - (-inf) would be NaN.
    m = tl.full((BLOCK_M,), LOWEST_FP32, tl.float32)
    d = tl.zeros((BLOCK_M,), tl.float32)
    o = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    whole_end = (seq_k // BLOCK_N) * BLOCK_N  # key blocks before this hold no padding
    if CAUSAL:  # blocks wholly left of the diagonal go unmasked; those right of the tile's last row are skipped
        unmasked_end = tl.minimum((start_m // BLOCK_N) * BLOCK_N, whole_end)
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        unmasked_end, end = whole_end, seq_k
    o, d, m = _forward_blocks(o, d, m, q, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows,
                              0, unmasked_end, seq_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, False, WIDE)
    o, d, m = _forward_blocks(o, d, m, q, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows,
                              unmasked_end, end, seq_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, True, WIDE)
    o_ptrs = o_ptr + batch * o_stride_b + head * o_stride_h + rows[:, None] * o_stride_s + dims[None, :] * o_stride_d
    tl.store(o_ptrs, (o / d[:, None]).to(o_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)
    tl.store(L_ptr + bh.to(tl.int64) * seq_q + rows, m + tl.math.log2(d), mask=rows < seq_q)


@triton.jit
def attention_delta_kernel(o_ptr, do_ptr, delta_ptr, o_stride_b, o_stride_h, o_stride_s, o_stride_d, do_stride_b,
                           do_stride_h, do_stride_s, do_stride_d, n_heads, seq_q, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, WIDE: tl.constexpr):
    """Backward preprocess: delta = rowsum(dO * O) (= rowsum(P * dP)), fp32, contiguous (batch, heads, seq_q)."""
    bh = tl.program_id(1)
    batch, head = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    rows, dims = _indices(tl.program_id(0) * BLOCK_M, BLOCK_M, WIDE), _indices(0, HEAD_DIM, WIDE)
    o_base, do_base = o_ptr + batch * o_stride_b + head * o_stride_h, do_ptr + batch * do_stride_b + head * do_stride_h
    o = tl.load(o_base + rows[:, None] * o_stride_s + dims[None, :] * o_stride_d, mask=rows[:, None] < seq_q, other=0.0)
    do = tl.load(do_base + rows[:, None] * do_stride_s + dims[None, :] * do_stride_d, mask=rows[:, None] < seq_q,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + bh.to(tl.int64) * seq_q + rows, delta, mask=rows < seq_q)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, L_base, delta_base, q_stride_s, q_stride_d, do_stride_s, do_stride_d,
                 cols, lo, hi, seq_q, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, WIDE: tl.constexpr):
    """Add query blocks [lo, hi) to a key tile's dK and dV. Works on transposed tiles (S^T, P^T: keys down, queries
    across) so the products need no transpose of P. MASKED: blocks the causal diagonal crosses and the ragged last
    one, whose padding queries load as zeros (q = dO = 0) but must still be masked: a key of inf times a q of 0 is
    NaN."""
    dims = _indices(0, HEAD_DIM, WIDE)
    for start_m in range(lo, hi, BLOCK_M):
        rows = _indices(start_m, BLOCK_M, WIDE)
        qT = tl.load(q_base + rows[None, :] * q_stride_s + dims[:, None] * q_stride_d, mask=rows[None, :] < seq_q,
                     other=0.0)
        do = tl.load(do_base + rows[:, None] * do_stride_s + dims[None, :] * do_stride_d, mask=rows[:, None] < seq_q,
                     other=0.0)
        L = tl.load(L_base + rows, mask=rows < seq_q, other=0.0)
        delta = tl.load(delta_base + rows, mask=rows < seq_q, other=0.0)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision="ieee") * qk_scale - L[None, :])
        if MASKED:
            keep = rows[None, :] < seq_q  # queries past the end, and (causal) before the key
            if CAUSAL:
                keep = keep & (rows[None, :] >= cols[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision="ieee")  # dV += P^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision="ieee")  # (dO V^T)^T
        dsT = pT * (dpT - delta[None, :])
        if MASKED:  # delta is NaN where O is (a NaN in V, or no finite score): the keys a query hides get 0, as torch's
            dsT = tl.where(keep, dsT, 0.0)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision="ieee")  # dK += dS^T Q (times scale at the end)
    return dk, dv


@triton.jit
def attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, L_ptr, delta_ptr,
    q_stride_b, q_stride_h, q_stride_s, q_stride_d, k_stride_b, k_stride_h, k_stride_s, k_stride_d,
    v_stride_b, v_stride_h, v_stride_s, v_stride_d, do_stride_b, do_stride_h, do_stride_s, do_stride_d,
    dk_stride_b, dk_stride_h, dk_stride_s, dk_stride_d,  # dk and dv: one layout
    n_heads, seq_q, seq_k, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr,
):
    """One program per (key tile, batch * head): dK and dV over the query tiles that see these keys."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)  # fp64 under torch.compile
    start_n, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    batch, head = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    cols, dims = _indices(start_n, BLOCK_N, WIDE), _indices(0, HEAD_DIM, WIDE)
    k_base, v_base = k_ptr + batch * k_stride_b + head * k_stride_h, v_ptr + batch * v_stride_b + head * v_stride_h
    k = tl.load(k_base + cols[:, None] * k_stride_s + dims[None, :] * k_stride_d, mask=cols[:, None] < seq_k, other=0.0)
    v = tl.load(v_base + cols[:, None] * v_stride_s + dims[None, :] * v_stride_d, mask=cols[:, None] < seq_k, other=0.0)
    q_base, do_base = q_ptr + batch * q_stride_b + head * q_stride_h, do_ptr + batch * do_stride_b + head * do_stride_h
    L_base, delta_base = L_ptr + bh.to(tl.int64) * seq_q, delta_ptr + bh.to(tl.int64) * seq_q
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    if CAUSAL:  # query tiles above these keys are skipped; those up to the tile after the diagonal are masked
        lo = (start_n // BLOCK_M) * BLOCK_M
        diagonal_end = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        lo, diagonal_end = 0, 0
    whole_end = tl.maximum((seq_q // BLOCK_M) * BLOCK_M, diagonal_end)  # query blocks before this hold no padding
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, L_base, delta_base, q_stride_s, q_stride_d, do_stride_s,
                          do_stride_d, cols, lo, tl.minimum(diagonal_end, seq_q), seq_q, qk_scale, HEAD_DIM, BLOCK_M,
                          CAUSAL, True, WIDE)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, L_base, delta_base, q_stride_s, q_stride_d, do_stride_s,
                          do_stride_d, cols, diagonal_end, whole_end, seq_q, qk_scale, HEAD_DIM, BLOCK_M, CAUSAL, False,
                          WIDE)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, L_base, delta_base, q_stride_s, q_stride_d, do_stride_s,
                          do_stride_d, cols, whole_end, seq_q, seq_q, qk_scale, HEAD_DIM, BLOCK_M, CAUSAL, True, WIDE)
    out = batch * dk_stride_b + head * dk_stride_h + cols[:, None] * dk_stride_s + dims[None, :] * dk_stride_d
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=cols[:, None] < seq_k)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=cols[:, None] < seq_k)


@triton.jit
def _dq_blocks(dq, q, do, L, delta, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows, lo, hi,
               seq_k, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, WIDE: tl.constexpr):
    """Add key blocks [lo, hi) to a query tile's dQ (the forward's walk, P recomputed from L)."""
    dims = _indices(0, HEAD_DIM, WIDE)
    for start_n in range(lo, hi, BLOCK_N):
        cols = _indices(start_n, BLOCK_N, WIDE)
        kT_ptrs = k_base + cols[None, :] * k_stride_s + dims[:, None] * k_stride_d
        vT_ptrs = v_base + cols[None, :] * v_stride_s + dims[:, None] * v_stride_d
        if MASKED:  # only a ragged last block reads past the end
            kT = tl.load(kT_ptrs, mask=cols[None, :] < seq_k, other=0.0)
            vT = tl.load(vT_ptrs, mask=cols[None, :] < seq_k, other=0.0)
        else:
            kT, vT = tl.load(kT_ptrs), tl.load(vT_ptrs)
        p = tl.math.exp2(tl.dot(q, kT, input_precision="ieee") * qk_scale - L[:, None])
        if MASKED:
            keep = cols[None, :] < seq_k  # keys past the end, and (causal) after the query
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT, input_precision="ieee")  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision="ieee")  # dQ += dS K (times scale at the end)
    return dq


@triton.jit
def attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, L_ptr, delta_ptr,
    q_stride_b, q_stride_h, q_stride_s, q_stride_d, k_stride_b, k_stride_h, k_stride_s, k_stride_d,
    v_stride_b, v_stride_h, v_stride_s, v_stride_d, do_stride_b, do_stride_h, do_stride_s, do_stride_d,
    dq_stride_b, dq_stride_h, dq_stride_s, dq_stride_d,
    n_heads, seq_q, seq_k, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr,
):
    """One program per (query tile, batch * head): dQ over the key tiles these queries see, as the forward walks."""
    scale, qk_scale = tl.cast(scale, tl.float32), tl.cast(qk_scale, tl.float32)  # fp64 under torch.compile
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    batch, head = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    rows, dims = _indices(start_m, BLOCK_M, WIDE), _indices(0, HEAD_DIM, WIDE)
    q_base, do_base = q_ptr + batch * q_stride_b + head * q_stride_h, do_ptr + batch * do_stride_b + head * do_stride_h
    q = tl.load(q_base + rows[:, None] * q_stride_s + dims[None, :] * q_stride_d, mask=rows[:, None] < seq_q, other=0.0)
    do = tl.load(do_base + rows[:, None] * do_stride_s + dims[None, :] * do_stride_d, mask=rows[:, None] < seq_q,
                 other=0.0)
    L = tl.load(L_ptr + bh.to(tl.int64) * seq_q + rows, mask=rows < seq_q, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * seq_q + rows, mask=rows < seq_q, other=0.0)
    k_base, v_base = k_ptr + batch * k_stride_b + head * k_stride_h, v_ptr + batch * v_stride_b + head * v_stride_h
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    whole_end = (seq_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        unmasked_end = tl.minimum((start_m // BLOCK_N) * BLOCK_N, whole_end)
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        unmasked_end, end = whole_end, seq_k
    dq = _dq_blocks(dq, q, do, L, delta, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows, 0,
                    unmasked_end, seq_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, False, WIDE)
    dq = _dq_blocks(dq, q, do, L, delta, k_base, v_base, k_stride_s, k_stride_d, v_stride_s, v_stride_d, rows,
                    unmasked_end, end, seq_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, True, WIDE)
    dq_ptrs = dq_ptr + batch * dq_stride_b + head * dq_stride_h + rows[:, None] * dq_stride_s \
        + dims[None, :] * dq_stride_d
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None] < seq_q)


_new_output = torch.empty  # output storage; tests fill it with NaN so that unwritten elements show
GRID_Y_LIMIT = 65535  # programs a CUDA grid takes along its second dim, batch * heads here


def wide_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element's offset within a (batch, head) of a tensor may pass 2**31: the kernels then index their
    rows and head_dim in 64 bits (``_indices``; batch and head offsets always are)."""
    return any(max(t.shape[2] - 1, 0) * t.stride(2) + max(t.shape[3] - 1, 0) * t.stride(3) >= 2**31 for t in tensors)


def _in_batch_chunks(body, tensors: tuple[torch.Tensor, ...], *rest) -> tuple[torch.Tensor, ...]:
    """``body`` on slices of the batch whose batch * heads programs fit a grid (GRID_Y_LIMIT), outputs joined."""
    heads = tensors[0].shape[1]
    if heads > GRID_Y_LIMIT:
        raise ValueError(f"{heads} heads: a launch takes at most {GRID_Y_LIMIT} (batch * heads) programs")
    rows = GRID_Y_LIMIT // heads
    parts = [body(*(t[start:start + rows] for t in tensors), *rest) for start in range(0, tensors[0].shape[0], rows)]
    return tuple(torch.cat(outputs) for outputs in zip(*parts, strict=True))


def _widened(body, tensors: tuple[torch.Tensor, ...], *rest) -> tuple[torch.Tensor, ...]:
    """``body`` on fp32 copies of bf16 ``tensors``, its 4-D outputs rounded back to bf16 (L stays fp32).
    Triton's interpreter keeps bf16 as raw 16-bit integers and tl.dot multiplies those, so on CPU the kernels see
    bf16 inputs as fp32; on a GPU they run in bf16."""
    outputs = body(*(t.float() for t in tensors), *rest)
    return tuple(t.to(torch.bfloat16) if t.ndim == 4 else t for t in outputs)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward launch, the body of ``softmax_course::attention``: (O, L), L each row's base-2 log-sum-exp (fp32)."""
    if scale < 0:  # the kernels scale the max of QK^T, the scores' max for a scale >= 0: the same scores are -scale
        return attention_forward(q, k.neg(), v, causal, -scale)  # times Q (-K)^T
    if INTERPRET and q.dtype == torch.bfloat16:  # see _widened
        return _widened(attention_forward, (q, k, v), causal, scale)
    batch, heads, seq_q, head_dim = q.shape
    if batch * heads > GRID_Y_LIMIT:
        return _in_batch_chunks(attention_forward, (q, k, v), causal, scale)
    o = _new_output(q.shape, dtype=q.dtype, device=q.device)
    L = _new_output((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    if o.numel() > 0:
        b = blocks_for("forward", head_dim, q.dtype)
        launch(attention_forward_kernel, (triton.cdiv(seq_q, b.block_m), batch * heads), q, k, v, o, L, *q.stride(),
               *k.stride(), *v.stride(), *o.stride(), heads, seq_q, k.shape[2], scale * LOG2E, HEAD_DIM=head_dim,
               BLOCK_M=b.block_m, BLOCK_N=b.block_n, CAUSAL=causal, WIDE=wide_offsets(q, k, v, o),
               num_warps=b.num_warps, num_stages=b.num_stages)
    return o, L


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       L: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward launches, the body of ``softmax_course::attention_backward``: (dQ, dK, dV) from the saved O and L
    (and an fp32 scratch delta)."""
    if scale < 0:  # as the forward ran, on -K with -scale: dQ = -scale dS (-K) is right as it is, dK is for -K
        dq, dk, dv = attention_backward(do, q, k.neg(), v, o, L, causal, -scale)
        return dq, dk.neg(), dv
    if INTERPRET and q.dtype == torch.bfloat16:
        return _widened(attention_backward, (do, q, k, v, o), L, causal, scale)
    batch, heads, seq_q, head_dim = q.shape
    if batch * heads > GRID_Y_LIMIT:
        return _in_batch_chunks(attention_backward, (do, q, k, v, o, L), causal, scale)
    seq_k = k.shape[2]
    dq = _new_output(q.shape, dtype=q.dtype, device=q.device)
    dk = _new_output(k.shape, dtype=k.dtype, device=k.device)
    dv = _new_output(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    L = L.contiguous()
    delta = torch.empty_like(L)
    wide = wide_offsets(do, q, k, v, o, dq, dk)  # (dv is laid out as dk)
    launch(attention_delta_kernel, (triton.cdiv(seq_q, DELTA_BLOCK_M), batch * heads), o, do, delta, *o.stride(),
           *do.stride(), heads, seq_q, HEAD_DIM=head_dim, BLOCK_M=DELTA_BLOCK_M, WIDE=wide)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    b = blocks_for("dkdv", head_dim, q.dtype)
    launch(attention_dkdv_kernel, (triton.cdiv(seq_k, b.block_n), batch * heads), q, k, v, do, dk, dv, L, delta,
           *common, *dk.stride(), heads, seq_q, seq_k, scale, scale * LOG2E, HEAD_DIM=head_dim, BLOCK_M=b.block_m,
           BLOCK_N=b.block_n, CAUSAL=causal, WIDE=wide, num_warps=b.num_warps, num_stages=b.num_stages)
    b = blocks_for("dq", head_dim, q.dtype)
    launch(attention_dq_kernel, (triton.cdiv(seq_q, b.block_m), batch * heads), q, k, v, do, dq, L, delta,
           *common, *dq.stride(), heads, seq_q, seq_k, scale, scale * LOG2E, HEAD_DIM=head_dim, BLOCK_M=b.block_m,
           BLOCK_N=b.block_n, CAUSAL=causal, WIDE=wide, num_warps=b.num_warps, num_stages=b.num_stages)
    return dq, dk, dv
