"""Time `vlmrl.data.synth.generate` (and, optionally, `save`).

Offline runs render their whole training set before the first RL step, so the
generator must stay at a few seconds for a few hundred items; this prints
items/second for rendering alone and for rendering plus writing PNGs.

Usage: PYTHONPATH=src python3 benchmarks/synth_speed.py [--n 300] [--size 512] [--repeat 3] [--save]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from vlmrl.data.synth import generate, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--save", action="store_true", help="also time writing PNGs and data.jsonl")
    args = parser.parse_args()

    best = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        records = generate(args.n, seed=0, image_size=args.size)
        best = min(best, time.perf_counter() - start)
    print(
        f"generate({args.n}, image_size={args.size}), best of {args.repeat}: "
        f"{best:.2f} s, {args.n / best:,.0f} items/s"
    )
    if args.save:
        with tempfile.TemporaryDirectory() as directory:
            start = time.perf_counter()
            save(records, directory)
            elapsed = time.perf_counter() - start
        print(f"save({args.n}): {elapsed:.2f} s, {args.n / elapsed:,.0f} items/s")


if __name__ == "__main__":
    main()
