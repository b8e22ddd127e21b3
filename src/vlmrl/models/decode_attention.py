"""Attention for one query token per row that reads only the filled part of the static cache
(issue 23). A CUDA graph replays fixed shapes, so the matrix products of the grouped attention
read the whole cache at every step, most of it still empty early in a completion; the kernel's
loop instead skips every block of slots that the step's mask leaves out (empty slots, left
padding), from one graph. The sequence is split over the SMs (flash-decoding): each program keeps
a running softmax over its share of the slots for the query heads of one key/value head, and a
second launch merges the shares. Scores, softmax and the weighted sum are float32; the output is
rounded once to the query's dtype."""

from __future__ import annotations

import functools

import torch

BLOCK_SLOTS = 32
SPLITS = 4  # shares of the slots per (row, key/value head): 4 x 128 programs at 16 rows


def kernel_available() -> bool:
    """Whether this machine can run the kernel: CUDA and Triton present."""
    from importlib.util import find_spec

    return torch.cuda.is_available() and find_spec("triton") is not None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_attention(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, length, chunk,
                          scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl,
                          stride_vb, stride_vh, stride_vl, stride_mb,
                          KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                          DIM: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        """Running max, sum and weighted values of one share of the slots, for the GROUP query
        heads of one (row, key/value head)."""
        row_head = tl.program_id(0)
        split = tl.program_id(1)
        row = row_head // KV_HEADS
        kv_head = row_head % KV_HEADS
        heads = tl.arange(0, G_PAD)
        dims = tl.arange(0, DIM)
        head_ok = heads < GROUP
        q = tl.load(q_ptr + row * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh
                    + dims[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
        running_max = tl.full((G_PAD,), -1e30, tl.float32)
        total = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, DIM), tl.float32)
        slots = tl.arange(0, BLOCK)
        k_base = k_ptr + row * stride_kb + kv_head * stride_kh
        v_base = v_ptr + row * stride_vb + kv_head * stride_vh
        start = split * chunk
        for first in range(start, start + chunk, BLOCK):
            at = first + slots
            inside = at < length
            read = tl.load(mask_ptr + row * stride_mb + at, mask=inside, other=0).to(tl.int32)
            if tl.sum(read, axis=0) > 0:  # a block the step's mask leaves out is not read
                keys = tl.load(k_base + at[:, None] * stride_kl + dims[None, :],
                               mask=inside[:, None], other=0.0).to(tl.float32)
                scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale
                scores = tl.where((read > 0)[None, :], scores, -float("inf"))
                new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                decay = tl.exp(running_max - new_max)
                weights = tl.exp(scores - new_max[:, None])
                total = total * decay + tl.sum(weights, axis=1)
                values = tl.load(v_base + at[:, None] * stride_vl + dims[None, :],
                                 mask=inside[:, None], other=0.0).to(tl.float32)
                acc = acc * decay[:, None] + tl.sum(weights[:, :, None] * values[None, :, :],
                                                    axis=1)
                running_max = new_max
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

    return triton, partial_attention, merge_shares


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     read: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of query [rows, heads, 1, dim] over the cache's key and value
    [rows, kv_heads, slots, dim] where `read` [rows, length] (bool, length <= slots) is true;
    returns [rows, 1, heads, dim] in the query's dtype."""
    triton, partial_attention, merge_shares = _kernels()
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    length = read.shape[-1]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    read = read if read.stride(-1) == 1 else read.contiguous()
    chunk = triton.cdiv(triton.cdiv(length, SPLITS), BLOCK_SLOTS) * BLOCK_SLOTS
    shares = rows * kv_heads * SPLITS * g_pad
    maxima = torch.empty(shares, dtype=torch.float32, device=query.device)
    totals = torch.empty(shares, dtype=torch.float32, device=query.device)
    acc = torch.empty(shares, dim, dtype=torch.float32, device=query.device)
    partial_attention[(rows * kv_heads, SPLITS)](
        query, key, value, read, maxima, totals, acc, length, chunk, float(scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), read.stride(0),
        KV_HEADS=kv_heads, GROUP=group, G_PAD=g_pad, DIM=dim, BLOCK=BLOCK_SLOTS, SPLITS=SPLITS,
        num_warps=4)
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    merge_shares[(rows * kv_heads,)](maxima, totals, acc, out, out.stride(0), out.stride(2),
                                     KV_HEADS=kv_heads, GROUP=group, G_PAD=g_pad, DIM=dim,
                                     SPLITS=SPLITS, num_warps=4)
    return out


@torch.library.custom_op("vlmrl::decode_attention", mutates_args=())
def decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        read: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` as one operator, which torch.compile calls as it is and a CUDA graph
    captures."""
    return decode_attention(query, key, value, read, scale)


@decode_attention_op.register_fake
def _(query, key, value, read, scale):
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)
