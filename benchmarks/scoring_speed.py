"""Time `vlmrl.rewards.scoring.score` over every MathVista testmini record.

The correctness reward runs the scorer on every completion of every RL step,
so it must stay far cheaper than generation; this prints records/second for a
correct, well-formed response to each record.

Usage: PYTHONPATH=src python3 benchmarks/scoring_speed.py [--data PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vlmrl.rewards.scoring import score

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "mathvista" / "testmini.json"


def load_records(path: Path) -> list[dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return list(data.values()) if isinstance(data, dict) else list(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    records = load_records(args.data)
    responses = [
        f"<REASONING>Reading the figure.</REASONING>\n<SOLUTION>{r['answer']}</SOLUTION>"
        for r in records
    ]
    best = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        right = sum(
            score(text, record).correct for text, record in zip(responses, records, strict=True)
        )
        best = min(best, time.perf_counter() - start)
    print(
        f"{len(records)} records, {right} correct, best of {args.repeat}: "
        f"{best * 1000:.1f} ms, {len(records) / best:,.0f} records/s"
    )


if __name__ == "__main__":
    main()
