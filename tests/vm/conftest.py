"""Fixtures for tests that boot the real default image under real QEMU (TCG)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import qprobe

IMAGE = os.environ.get("QPROBE_TEST_IMAGE", "debian-cloud")


def workload_result(output: str) -> dict[str, str]:
    """The ``key=value`` summary line the guest workload prints."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


@pytest.fixture(scope="module")
def target() -> Iterator[qprobe.Target]:
    """One booted guest per test module (KASLR on, smp 2)."""
    with qprobe.boot(IMAGE, smp=2) as t:
        yield t
        assert t.oopses() == [], "the guest oopsed:\n" + t.console.tail(60)  # type: ignore[union-attr]


@pytest.fixture
def guard(target: qprobe.Target) -> Iterator[dict[int, bytes]]:
    """Snapshot of kernel text; after the test no probe is left and the text is byte-identical."""
    names = ["ksys_lseek", "__x64_sys_getppid", "__x64_sys_lseek", "vfs_read", "ksys_read", "vfs_write"]
    snap = {target.symbols.address(n): target.read(n, target.symbols.lookup(n).size) for n in names}
    yield snap
    for kp_point in list(target.kprobes.points.values()):
        target.unregister_kprobes(list(kp_point.probes))
        pytest.fail(f"a probe was left registered at {kp_point.where}")
    for addr, data in snap.items():
        assert target.read(addr, len(data)) == data, f"kernel text changed at {target.symbols.symbolize(addr)}"
    assert [p.what for p in target.journal.patches.values()] in ([], ["pmd"])
    assert target.oopses() == [], target.console.tail(60)  # type: ignore[union-attr]
