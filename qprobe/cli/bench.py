"""``qprobe bench`` and ``qprobe demo``, each run by its own module."""

from __future__ import annotations

import argparse

# qprobe bench's parts: the probe-cost matrix, trace lines through the record rings, scale, the GDB rows,
# one count from every front end
BENCH_SECTIONS = ("probes", "trace", "scale", "gdb", "maps")


def _sections(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in BENCH_SECTIONS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: sections are {', '.join(BENCH_SECTIONS)}")
    return parts


def cmd_demo(args: argparse.Namespace) -> int:
    from qprobe.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from qprobe.bench import run_bench

    return run_bench(args)
