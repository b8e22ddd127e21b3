"""bitsandbytes' NF4 code book and the PTX that looks it up in registers, for the decode kernel of
`vlmrl.training.rollout.nf4_kernels`: apart from the kernels so that they are tested without Triton
(tests/test_nf4_decode.py runs the PTX through a small interpreter of its instructions)."""

from __future__ import annotations

import torch

# bitsandbytes' NF4 code book (`bitsandbytes.functional.get_4bit_type("nf4")`), by 4-bit code
NF4_CODES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def code_bytes(shift: int) -> list[int]:
    """Byte `shift // 8` of each NF4 value's fp16 bits, four codes to a 32-bit word (code 4i in
    the word's low byte): the tables `prmt` picks from."""
    bits = [int(v) & 0xFFFF for v in torch.tensor(NF4_CODES, dtype=torch.float16).view(torch.int16)]
    picked = [(v >> shift) & 0xFF for v in bits]
    return [sum(picked[4 * word + i] << (8 * i) for i in range(4)) for word in range(4)]


def nf4_lookup_asm() -> str:
    """PTX for four packed bytes ($4) to the fp16 NF4 values of their high nibbles ($0, $1: two
    bytes each) and low nibbles ($2, $3). Each value's low and high byte is looked up with
    `prmt` (byte permute: four 3-bit picks out of two 32-bit words, i.e. eight table entries at
    once), a third `prmt` keeps the pick of the half of the table that the code's top bit names,
    and a last one interleaves low and high bytes into fp16 pairs (the values equal tf32's
    rounding of the float32 code book)."""
    lines = [".reg .b32 l<4>, h<4>, q, s, m, la, lb, ha, hb, lo, hi;"]
    lines += [f"mov.b32 l{i}, {word:#010x};" for i, word in enumerate(code_bytes(0))]
    lines += [f"mov.b32 h{i}, {word:#010x};" for i, word in enumerate(code_bytes(8))]
    for source, even, odd in (("$4", "$0", "$2"), ("q", "$1", "$3")):
        if source == "q":
            lines.append("shr.b32 q, $4, 16;")  # bytes 2 and 3; prmt reads 16 selector bits
        # selector nibble i is byte i // 2's low (i even) or high nibble: output byte i's code
        lines += [f"and.b32 s, {source}, 0x7777;",
                  f"shr.b32 m, {source}, 1;", "and.b32 m, m, 0x4444;", "or.b32 m, m, 0x3210;",
                  "prmt.b32 la, l0, l1, s;", "prmt.b32 lb, l2, l3, s;", "prmt.b32 lo, la, lb, m;",
                  "prmt.b32 ha, h0, h1, s;", "prmt.b32 hb, h2, h3, s;", "prmt.b32 hi, ha, hb, m;",
                  f"prmt.b32 {even}, lo, hi, 0x7351;", f"prmt.b32 {odd}, lo, hi, 0x6240;"]
    return "{\n" + "\n".join(lines) + "\n}"
