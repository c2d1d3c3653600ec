"""Issue 8: a bounded soak with 256 probes and kretprobes armed at once (smp 2).

Linux's multiple_kprobes selftest places 256 probes; here they go on 256
distinct syscall entry functions, with kretprobes besides, while the guest
runs a mix of workloads for ``QPROBE_SOAK_SECONDS`` (60 in ``make test``,
600 in ``make soak``).  Every getppid and lseek the workload made must be
accounted for (hits + nmissed), no oops, the text byte-identical afterwards;
the host process's memory is reported.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

import qprobe
from qprobe import Kprobe, Kretprobe
from qprobe.errors import ProbeError

from .conftest import workload_result

pytestmark = pytest.mark.vm
SECONDS = float(os.environ.get("QPROBE_SOAK_SECONDS", "60"))
ROUND = "workload getppid 500; workload lseek 100; workload read 20 64; workload open 10 /etc/passwd; workload fork 3"


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def test_soak_256_probes_and_kretprobes(target: qprobe.Target, record_property: object) -> None:
    names = sorted(n for n in target.symbols.names() if n.startswith("__x64_sys_"))
    chosen: list[str] = []
    for name in names:
        try:
            target.kprobes.sites.check_kprobe_address_safe(target.symbols.address(name))
        except ProbeError:
            continue
        chosen.append(name)
    assert "__x64_sys_getppid" in chosen
    chosen = ["__x64_sys_getppid", *[n for n in chosen if n != "__x64_sys_getppid"][:255]]
    probes = {name: Kprobe(symbol_name=name) for name in chosen}
    rets = {name: Kretprobe(symbol_name=name) for name in ("ksys_lseek", "ksys_read", "do_sys_openat2")}
    before = {name: target.read(name, 16) for name in [*chosen, *rets]}
    target.register_kprobes(list(probes.values()))
    target.register_kretprobes(list(rets.values()))
    optimized = target.list_probes().count("[OPTIMIZED]")
    rss0 = _rss_mib()
    getppids = lseeks = rounds = 0
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline:
            out = target.run(ROUND, timeout=600).check().output
            for line in out.splitlines():
                if line.startswith("workload "):
                    res = workload_result(line)
                    assert res.get("errors", "0") == "0", line
                    if res["mode"] == "getppid":
                        getppids += int(res["n"])
                    elif res["mode"] == "lseek":
                        lseeks += int(res["n"])
            rounds += 1
    finally:
        target.unregister_kretprobes(list(rets.values()))
        target.unregister_kprobes(list(probes.values()))
    rss1 = _rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nsoak: {rounds} rounds in {SECONDS:g} s, {len(probes)} kprobes ({optimized} optimized) + "
        f"{len(rets)} kretprobes, {sum(p.nhit for p in probes.values())} kprobe hits, "
        f"host RSS {rss0:.0f} -> {rss1:.0f} MiB (peak {peak:.0f})"
    )
    record_property("host_rss_mib", f"{rss0:.0f}->{rss1:.0f}")  # type: ignore[operator]
    gp = probes["__x64_sys_getppid"]
    assert rounds >= 1 and getppids == 500 * rounds
    # Nothing else in the guest calls getppid: every call the workload made is accounted for.
    assert gp.nhit + gp.nmissed == getppids
    # lseek: every call entered (the rest of the guest does not seek either).
    assert rets["ksys_lseek"].nhit + rets["ksys_lseek"].nmissed == lseeks
    assert all(not rp.live for rp in rets.values())
    for name, data in before.items():
        assert target.read(name, 16) == data, f"{name} text changed"
    assert target.oopses() == [], target.console.tail(60)  # type: ignore[union-attr]
