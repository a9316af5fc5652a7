"""Argument types shared by the subcommands, so that a flag reads the same way everywhere."""

from __future__ import annotations

import argparse


def lengths(text: str) -> list[int]:
    """`1024,4k,16k` -> [1024, 4096, 16384] (k = 1024, as RULER's 4k / 16k)."""
    try:
        return [int(x.strip()[:-1]) * 1024 if x.strip().lower().endswith("k") else int(x)
                for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (4k = 4096), got '{text}'") from None


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
