"""The Triton kernels of `vlmrl.training.rollout.decode_attention.cache_attention` (see there), apart so
that importing that module needs no Triton: this one is imported where the kernel runs. Under
Triton's interpreter (TRITON_INTERPRET=1 when this module is imported, the CPU tests), whose
`range` cannot take bounds computed in the kernel, the slot loop is a `while` over the same
blocks."""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def attend_block(q, k_base, v_base, row_mask, first, stop, scale, stride_kl, stride_vl,
                 running_max, total, acc, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """The running softmax after the BLOCK slots from `first` (those at `stop` and past it,
    and those the mask leaves out, scored -inf)."""
    at = first + tl.arange(0, BLOCK)
    dims = tl.arange(0, DIM)
    inside = at < stop
    read = tl.load(row_mask + at, mask=inside, other=0) != 0
    keys = tl.load(k_base + at[:, None] * stride_kl + dims[None, :], mask=inside[:, None],
                   other=0.0).to(q.dtype)
    values = tl.load(v_base + at[:, None] * stride_vl + dims[None, :], mask=inside[:, None],
                     other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(keys)) * scale
    scores = tl.where(read[None, :], scores, -float("inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    decay = tl.exp(running_max - new_max)
    weights = tl.exp(scores - new_max[:, None])
    total = total * decay + tl.sum(weights, axis=1)
    acc = acc * decay[:, None] + tl.dot(weights.to(q.dtype), values)
    return new_max, total, acc


@triton.jit
def partial_attention(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, length,
                      scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl,
                      stride_vb, stride_vh, stride_vl, stride_mb, stride_ob, stride_oh,
                      KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                      DIM: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                      LENGTH_PAD: tl.constexpr, WHILE: tl.constexpr):
    """Running max, sum and weighted values of one share of a row's read slots, for the
    GROUP query heads of one (row, key/value head); with one share, their attention."""
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    row = row_head // KV_HEADS
    kv_head = row_head % KV_HEADS
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, DIM)
    head_ok = heads < GROUP
    positions = tl.arange(0, LENGTH_PAD)
    row_reads = tl.load(mask_ptr + row * stride_mb + positions, mask=positions < length,
                        other=0) != 0
    end = tl.max(tl.where(row_reads, positions + 1, 0), axis=0)
    begin = tl.min(tl.where(row_reads, positions, end), axis=0) // BLOCK * BLOCK
    chunk = tl.cdiv(tl.cdiv(end - begin, SPLITS), BLOCK) * BLOCK
    start = begin + split * chunk
    stop = tl.minimum(start + chunk, end)
    q = tl.load(q_ptr + row * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh
                + dims[None, :], mask=head_ok[:, None], other=0.0)
    running_max = tl.full((G_PAD,), -1e30, tl.float32)
    total = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, DIM), tl.float32)
    k_base = k_ptr + row * stride_kb + kv_head * stride_kh
    v_base = v_ptr + row * stride_vb + kv_head * stride_vh
    if WHILE:
        first = start
        while first < stop:
            running_max, total, acc = attend_block(
                q, k_base, v_base, mask_ptr + row * stride_mb, first, stop, scale,
                stride_kl, stride_vl, running_max, total, acc, DIM, BLOCK)
            first += BLOCK
    else:
        for first in range(start, stop, BLOCK):
            running_max, total, acc = attend_block(
                q, k_base, v_base, mask_ptr + row * stride_mb, first, stop, scale,
                stride_kl, stride_vl, running_max, total, acc, DIM, BLOCK)
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + (kv_head * GROUP + heads)[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        share = (row_head * SPLITS + split) * G_PAD + heads
        tl.store(m_ptr + share, running_max)
        tl.store(l_ptr + share, total)
        tl.store(acc_ptr + share[:, None] * DIM + dims[None, :], acc)


@triton.jit
def merge_shares(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                 DIM: tl.constexpr, SPLITS: tl.constexpr):
    """out = the shares' weighted values, each rescaled to the overall max, over their
    summed weights."""
    row_head = tl.program_id(0)
    row = row_head // KV_HEADS
    kv_head = row_head % KV_HEADS
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, DIM)
    shares = tl.arange(0, SPLITS)
    at = (row_head * SPLITS + shares)[:, None] * G_PAD + heads[None, :]
    maxima = tl.load(m_ptr + at)
    overall = tl.max(maxima, axis=0)
    scales = tl.exp(maxima - overall[None, :])
    total = tl.sum(scales * tl.load(l_ptr + at), axis=0)
    acc = tl.load(acc_ptr + at[:, :, None] * DIM + dims[None, None, :])
    out = tl.sum(scales[:, :, None] * acc, axis=0) / total[:, None]
    tl.store(out_ptr + row * stride_ob + (kv_head * GROUP + heads)[:, None] * stride_oh
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(heads < GROUP)[:, None])
