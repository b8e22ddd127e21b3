"""A named pass/fail finding with its detail: what verify_lora and export record per check and
write into their metrics, so a failed stage lists every check that failed, not just the first."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
