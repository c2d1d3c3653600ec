"""``qprobe bench``: the numbers docs/performance.md quotes, measured on this machine.

Speed is checked here, with a report, never by timed assertions in tests.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import qprobe
from qprobe.kernel import symbols as symbols_mod


def _time(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def _guest_seconds(target: qprobe.Target, cmd: str) -> float:
    t = time.perf_counter()
    target.run(cmd, timeout=1800).check()
    return time.perf_counter() - t


def run_bench(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    with qprobe.boot(args.image, smp=args.smp, memory=args.memory) as target:
        rows.append(("boot to guest shell (cached image)", f"{target.timings['boot']:.2f} s"))
        rows.append(("boot + attach (symbols, KASLR, journal)", f"{time.perf_counter() - t0:.2f} s"))
        vmlinux = target.symbols.path
        t = time.perf_counter()
        syms, _, _ = symbols_mod._parse_with_lief(vmlinux)
        rows.append((f"symbols, cold (LIEF parse, {len(syms)} symbols)", f"{time.perf_counter() - t:.2f} s"))
        t = time.perf_counter()
        symbols_mod.Symbols.load(vmlinux)
        rows.append(("symbols, cached by build-id", f"{time.perf_counter() - t:.2f} s"))

        gdb = target.gdb
        tid = target.machine.vcpus[0]
        addr = target.symbols.address("linux_banner")

        def stub_rtts() -> tuple[float, float]:
            g = _time(lambda: gdb.read_registers(tid), 300)
            gdb.set_physical(True)
            phys = target.mem.virt_to_phys(addr)
            m = _time(lambda: gdb.read_memory(phys, 64), 300)
            return g, m

        g, m = target.machine.call(stub_rtts)
        rows.append(("gdbstub `g` round trip (all registers)", f"{g * 1e6:.0f} µs"))
        rows.append(("gdbstub `m` round trip (64 bytes)", f"{m * 1e6:.0f} µs"))
        shared = _time(lambda: target.read(addr, 64), 3000)
        rows.append(("shared-RAM read, 64 bytes (page walk included, VM running)", f"{shared * 1e6:.1f} µs"))

        n = args.hits
        cmd = f"workload getppid {n}"
        base = statistics.median(_guest_seconds(target, cmd) for _ in range(3))
        rows.append((f"`{cmd}` unprobed", f"{base:.2f} s"))
        modes = (("int3, single-step", False, False), ("int3, boosted", True, False),
                 ("jump-optimized, no VM stop", True, True))  # fmt: skip
        for label, boost, optimize in modes:
            target.kprobes.boost = boost
            if target.kprobes.optimizer is not None and target.kprobes.optimizer.available:
                target.set_kprobes_optimization(optimize)
            elif optimize:
                continue
            runs = n * 10 if optimize else n
            for kind, probe in (("kprobe", qprobe.Kprobe(symbol_name="__x64_sys_getppid")),
                                ("kretprobe", qprobe.Kretprobe(symbol_name="__x64_sys_getppid"))):  # fmt: skip
                if isinstance(probe, qprobe.Kretprobe):
                    target.register_kretprobe(probe)
                else:
                    target.register_kprobe(probe)
                try:
                    probed = _guest_seconds(target, f"workload getppid {runs}")
                finally:
                    if isinstance(probe, qprobe.Kretprobe):
                        target.unregister_kretprobe(probe)
                    else:
                        target.unregister_kprobe(probe)
                added = (probed - base * runs / n) / max(probe.nhit, 1) * 1e6
                what = (
                    f"`workload getppid {runs}`, {kind} on __x64_sys_getppid: {label} "
                    f"({probe.nhit} hits, {probe.nmissed} missed)"
                )
                rate = f"{probed:.2f} s = {probe.nhit / probed:,.0f} hits/s, {added:,.0f} µs added per hit"
                rows.append((what, rate))
    report = [
        f"qprobe bench: {platform.node()}, {platform.machine()}, image {args.image}, smp {args.smp}, "
        f"memory {args.memory}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| measurement | result |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
    ]
    text = "\n".join(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0
