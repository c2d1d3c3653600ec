"""The gdb/MI transport (qprobe.vmm.gdbmi) against the real default image under QEMU 7.2.

It must be a drop-in for the RSP client: the same answers on the same stopped
VM, and a whole Target (stop loop, kprobes) running over it.  QEMU's gdbstub
takes one client at a time, so the two transports take turns on one VM.
Per-hit costs are printed, never asserted (the machine is shared and noisy).
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable, Iterator

import pytest

import qprobe
import qprobe.wiring
from qprobe.errors import TargetError
from qprobe.images import get_image
from qprobe.paths import cache_dir
from qprobe.vmm.connection import Connection
from qprobe.vmm.console import Console, open_shell
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.gdbremote import GdbRemote
from qprobe.vmm.qemu import QemuProcess
from qprobe.vmm.transport import GdbTransport

from .conftest import IMAGE, bare_qemu, workload_result

pytestmark = pytest.mark.vm
HITS = 20
_OOPS = re.compile(r"(BUG: |Oops: |Kernel panic|general protection fault|WARNING: CPU: |kernel BUG at)")


@pytest.fixture(scope="module")
def vm() -> Iterator[QemuProcess]:
    """Our own QEMU booted to the guest shell, nobody attached; never left running."""
    with bare_qemu() as q:
        yield q
        log = q.console_log.read_text(errors="replace")
        assert not _OOPS.search(log), "the guest oopsed:\n" + "\n".join(log.splitlines()[-60:])


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """Measurements go to the terminal even without -s: they are the point of running this."""
    with capsys.disabled():
        print(f"\n[gdbmi] {line}")


# -- the same answers on the same stopped VM -------------------------------------------------------
Sample = tuple[str, object]


def _samples(gdb: GdbTransport, plan: list[tuple[str, str, int, int]]) -> list[Sample]:
    """Run a plan of reads; a failed read is a result too (both transports must fail alike)."""
    out: list[Sample] = []
    for op, tid, addr, size in plan:
        try:
            if op == "regs":
                out.append(("regs", gdb.read_registers(tid)))
            else:
                gdb.select(tid)
                gdb.set_physical(op == "phys")
                out.append((op, gdb.read_memory(addr, size)))
        except TargetError:
            out.append((op, "error"))
    gdb.set_physical(False)
    return out


def _guest_answers(vm: QemuProcess) -> bool:
    """True if the guest shell answers: the VM runs (a detach must leave it running)."""
    console = Console(vm.console_path, alive=vm.alive)
    shell = open_shell(console, vm.shell_path, vm.alive, None)
    try:
        return shell.run("echo alive", timeout=60).output.strip() == "alive"
    finally:
        shell.close()
        console.close()


def _rtt(fn: Callable[[], object], n: int = 50) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def test_gdb_transport_reads_what_the_rsp_transport_reads(vm: QemuProcess, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"unix:{vm.gdb_path}"
    raw = GdbRemote(Connection.open(address, vm.alive))
    raw.handshake()
    try:
        tids = raw.threads()
        regs = [raw.read_registers(t) for t in tids]
        # Virtual reads through a vCPU in kernel mode (with PTI a user-mode one may not map the kernel).
        kernel = [t for t, r in zip(tids, regs, strict=True) if r["cs"] & 3 == 0]
        rip = next((r["rip"] for t, r in zip(tids, regs, strict=True) if kernel and t == kernel[0]), 0)
        rng = random.Random(7)
        plan = [("regs", tids[i % len(tids)], 0, 0) for i in range(100)]
        for i in range(100):
            if i % 2 and kernel:  # close around the idle loop: kernel text, mapped the same on every vCPU
                addr, size = rip - (128 << 10) + rng.randrange(256 << 10), rng.randrange(1, 300)
                plan.append(("virt", kernel[i % len(kernel)], addr, size))
            else:
                plan.append(("phys", tids[0], rng.randrange(vm.config.memory - 4096), rng.randrange(1, 4096)))
        rng.shuffle(plan)
        want = _samples(raw, plan)
        raw_g = _rtt(lambda: raw.read_registers(tids[0]))
    finally:
        raw.conn.close()  # no detach: QEMU 7.2 keeps the VM stopped for the next client
    mi = GdbMiRemote(address, alive=vm.alive)
    try:
        stop = mi.handshake()
        assert stop.kind == "T" and stop.thread in tids
        assert mi.threads() == tids
        assert mi.regs == raw.regs  # the same target description, read by gdb
        got = _samples(mi, plan)
        mi_g = _rtt(lambda: mi.read_registers(tids[0]))
        mi.select(tids[0])
        text = mi.console("info registers rip")
        assert "rip" in text and f"{regs[0]['rip']:#x}" in text
        with pytest.raises(TargetError, match="end qprobe's session"):
            mi.console("detach")
    finally:
        mi.detach()
    assert _guest_answers(vm), "the VM did not run on after the gdb transport detached"
    assert [op for op, _ in got] == [op for op, _ in want]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"read {i} {plan[i][:2]} at {plan[i][2]:#x}: gdb {a!r:.200} != rsp {b!r:.200}"
    ok = sum(1 for _, v in want if v != "error")
    assert ok >= 190, f"only {ok} of 200 reads succeeded: the comparison proves little"
    assert all(isinstance(v, dict) and {"rip", "cr3", "efer", "gs_base"} <= v.keys() for op, v in want if op == "regs")
    _report(capsys, f"all registers of one vCPU: rsp transport {raw_g * 1e6:.0f} us, gdb transport {mi_g * 1e6:.0f} us")


# -- a whole Target over each transport -----------------------------------------------------------
class _Address:
    """Stands in for ``Connection`` in qprobe.wiring: the patched Target hands GdbMiRemote the address."""

    @staticmethod
    def open(address: str, alive: Callable[[], bool] | None = None) -> tuple[str, Callable[[], bool] | None]:
        return address, alive


def _gdb_transport(opened: tuple[str, Callable[[], bool] | None]) -> GdbMiRemote:
    address, alive = opened
    return GdbMiRemote(address, alive=alive)


def _attach(vm: QemuProcess) -> qprobe.Target:
    img = get_image(IMAGE, fetch=False)
    return qprobe.attach(f"unix:{vm.gdb_path}", img.vmlinux, ram=vm.ram_path, ram_size=vm.config.memory,
                         console=vm.console_path, shell=vm.shell_path)  # fmt: skip


def _guest_seconds(t: qprobe.Target, command: str) -> float:
    start = time.perf_counter()
    res = workload_result(t.run(command, timeout=600).check().output)
    assert int(res["n"]) == HITS and int(res["errors"]) == 0
    return time.perf_counter() - start


@pytest.mark.parametrize("transport", ["gdb", "rsp"])
def test_kprobe_counts_hits_over_each_transport(vm: QemuProcess, transport: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    if transport == "gdb":
        monkeypatch.setattr(qprobe.wiring, "Connection", _Address)
        monkeypatch.setattr(qprobe.wiring, "GdbRemote", _gdb_transport)
    with _attach(vm) as t:
        assert isinstance(t.gdb, GdbMiRemote if transport == "gdb" else GdbRemote)
        sym = t.symbols.lookup("__x64_sys_getppid")
        text = t.read(sym.addr, sym.size)
        command = f"workload getppid {HITS}"
        base = statistics.median(_guest_seconds(t, command) for _ in range(3))
        kp = qprobe.Kprobe(symbol_name="__x64_sys_getppid")
        t.register_kprobe(kp)
        try:
            assert t.read(kp.resolved, 1) == b"\xcc"  # after the __fentry__ site, which qprobe leaves alone
            probed = _guest_seconds(t, command)
        finally:
            t.unregister_kprobe(kp)
        assert kp.nhit == HITS and kp.nmissed == 0 and kp.nfaults == 0
        assert t.read(sym.addr, sym.size) == text, "kernel text was not restored"
        assert not t.kprobes.handlers.errors, t.kprobes.handlers.errors.lines
        if transport == "gdb":
            gdb = t.gdb
            assert isinstance(gdb, GdbMiRemote)
            entry = t.symbols.address("asm_exc_int3")
            assert "rip" in (t.gdb_command("info registers rip") or "")
            # With the slide, gdb's symbols are the running kernel's: the raw command sees real names,
            # and with the DWARF (through the index cache the shell's static gdb shares) real lines.
            t.machine.call(lambda: gdb.load_symbols(t.symbols.path, t.slide))
            assert "asm_exc_int3" in (t.gdb_command(f"info symbol {entry:#x}") or "")
            index = cache_dir("gdb-index")
            t.machine.call(lambda: gdb.load_symbols(t.symbols.path, t.slide, index_dir=index), timeout=900)
            line = t.gdb_command("info line vfs_read") or ""
            assert f"{t.symbols.address('vfs_read'):#x} <vfs_read>" in line, line
        else:
            assert t.gdb_command("info registers rip") is None  # no gdb behind the rsp transport
        assert t.oopses() == [], t.console.tail(60) if t.console else ""
    if transport == "gdb":
        # gdb detaches with ``D;1``; QEMU 7.2 refuses a bare ``D`` once multiprocess+ is negotiated.
        assert _guest_answers(vm), "the VM did not run on after the gdb transport detached"
    _report(capsys, f"{transport} transport: workload getppid {HITS}: unprobed {base:.2f} s, probed {probed:.2f} s, "
                    f"{(probed - base) / HITS * 1e3:.0f} ms per hit")  # fmt: skip
