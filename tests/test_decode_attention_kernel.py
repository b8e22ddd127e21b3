"""`vlmrl.training.rollout.decode_attention.cache_attention` under Triton's interpreter on the CPU: each
row reads from its first to its last read slot, in one share per (row, key/value head) or
several merged, against float64 attention over the same values. In float16: the interpreter
reads bfloat16 wrongly; one test compiles the kernel for an H100 on this CPU. bfloat16, float8
and speed on a GPU: tests/gpu/test_graph_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

from vlmrl.training.rollout import decode_attention

pytest.importorskip("triton")


def reference(query, key, value, read, scale):
    """float64 attention of each row's query heads over the slots `read` marks."""
    group = query.shape[1] // key.shape[1]
    keys = key[:, :, :read.shape[-1]].double().repeat_interleave(group, dim=1)
    values = value[:, :, :read.shape[-1]].double().repeat_interleave(group, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~read[:, None, None, :], -float("inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


def masks(rows: int, length: int) -> dict[str, torch.Tensor]:
    """A step's mask as generation makes it (left padding, then the slots written so far), one
    with holes inside a row's span, one whose rows read a single slot or run to the end, and one
    of two runs of slots far apart (a share's first blocks then read nothing)."""
    generator = torch.Generator().manual_seed(0)
    slot = torch.arange(length)
    pads = torch.randint(0, 70, (rows, 1), generator=generator)
    ends = torch.randint(80, length + 1, (rows, 1), generator=generator)
    step = (slot >= pads) & (slot < ends)
    holes = step & (torch.rand(rows, length, generator=generator) > 0.3)
    edges = torch.zeros(rows, length, dtype=torch.bool)
    edges[0, length - 1] = True
    edges[1, 0] = True
    edges[2:, 5:] = True
    apart = torch.zeros(rows, length, dtype=torch.bool)
    apart[:, :4] = apart[:, 150:] = True
    return {"step": step, "holes": holes, "edges": edges, "apart": apart}


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("mask", ["step", "holes", "edges", "apart"])
def test_cache_attention_reads_each_rows_span_as_float64_attention(monkeypatch, splits, mask):
    monkeypatch.setattr(decode_attention, "SPLITS", splits)
    monkeypatch.setattr(decode_attention, "BLOCK_SLOTS", 16)
    rows, heads, kv_heads, dim, slots, length = 4, 4, 2, 16, 208, 200
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(rows, heads, 1, dim, generator=generator).to(torch.float16)
    key, value = (torch.randn(rows, kv_heads, slots, dim, generator=generator).to(torch.float16)
                  for _ in range(2))
    read = masks(rows, length)[mask]
    got = decode_attention.cache_attention(query, key, value, read, dim ** -0.5)
    expected = reference(query, key, value, read, dim ** -0.5)
    assert got.shape == (rows, 1, heads, dim) and got.dtype == torch.float16
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=2e-3)


def test_slots_outside_the_mask_do_not_reach_the_output(monkeypatch):
    """Values far past any real one in every slot a row does not read (its padding, the slots
    past the step, holes): the output stays within the read values' range."""
    monkeypatch.setattr(decode_attention, "BLOCK_SLOTS", 16)
    rows, heads, kv_heads, dim, length = 4, 2, 1, 16, 96
    read = masks(rows, length)["holes"]
    query = torch.randn(rows, heads, 1, dim).to(torch.float16)
    key = torch.randn(rows, kv_heads, length, dim).to(torch.float16)
    value = torch.rand(rows, kv_heads, length, dim).to(torch.float16)
    value.masked_fill_(~read[:, None, :, None], 1e4)
    got = decode_attention.cache_attention(query, key, value, read, dim ** -0.5)
    assert got.abs().max() <= 1.0


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("splits", [1, 2])
def test_a_row_that_reads_no_slot_gets_nan_and_the_others_their_attention(monkeypatch, splits):
    monkeypatch.setattr(decode_attention, "SPLITS", splits)
    monkeypatch.setattr(decode_attention, "BLOCK_SLOTS", 16)
    rows, heads, kv_heads, dim, length = 2, 2, 1, 16, 40
    read = torch.zeros(rows, length, dtype=torch.bool)
    read[1, 3:30] = True
    query = torch.randn(rows, heads, 1, dim).to(torch.float16)
    key, value = (torch.randn(rows, kv_heads, length, dim).to(torch.float16) for _ in range(2))
    got = decode_attention.cache_attention(query, key, value, read, dim ** -0.5)
    assert got[0].isnan().all()
    expected = reference(query, key, value, read, dim ** -0.5)
    torch.testing.assert_close(got[1].double(), expected[1], atol=2e-3, rtol=2e-3)


COMPILE_FOR_SM90 = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vlmrl.training.rollout import attention_kernels

kernel = attention_kernels.partial_attention
types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "mask_ptr": "*i1",
         "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
         "scale": "fp32"}
constexprs = dict(KV_HEADS=8, GROUP=2, G_PAD=16, DIM=128, BLOCK=64, SPLITS=1, LENGTH_PAD=2048,
                  WHILE=False)
signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
             for name in kernel.arg_names}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3})
print(json.dumps({"loads": compiled.asm["ptx"].count("ld.global")}))
"""


def test_the_kernel_compiles_for_an_h100() -> None:
    """Ahead of time for sm_90, in a process of its own (the tests run Triton's interpreter,
    which compiles nothing): the float8 cache's kernel as decode steps launch it."""
    import json
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["loads"] > 0
