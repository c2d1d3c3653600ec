"""A uprobe through a process's life: every case users expect to be probed is, and no process is hurt.

The programs are the guest's ``uprog`` (dynamic PIE with ``/usr/lib/libqpt.so``) and ``uprog-static``;
each run's expected counts come from the program's own summary line (``calls=``, ``uprog-child ...
calls=``), never from qprobe.  Every test ends with the probed files' md5sum unchanged in the guest and
each program exiting 0 with ``bad=0`` (no SIGTRAP, no crash); the plugin fails a test that left anything
new on the console.  The file offsets come from the host's copy of the guest tree (the same bytes).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import lief
import pytest

import qprobe
from qprobe import Uprobe, Uretprobe, regs_return_value
from qprobe.images.guest import guest_tree

from .conftest import IMAGE, readline_matching

pytestmark = pytest.mark.vm

PROG = "/bin/uprog"
STATIC = "/bin/uprog-static"
LIB = "/usr/lib/libqpt.so"
FILES = (PROG, STATIC, LIB)
ROOT = Path(__file__).resolve().parents[2]


def file_offset(path: str, symbol: str) -> int:
    elf = lief.parse(str(guest_tree() / path.lstrip("/")))
    assert elf is not None
    return int(elf.virtual_address_to_offset(elf.get_symbol(symbol).value))


@pytest.fixture(scope="module")
def off() -> dict[str, int]:
    return {
        PROG: file_offset(PROG, "qpt_target"),
        STATIC: file_offset(STATIC, "qpt_target"),
        LIB: file_offset(LIB, "qpt_lib_add"),
        "recurse": file_offset(PROG, "qpt_recurse"),
    }


def md5(target: qprobe.Target) -> dict[str, str]:
    out = target.run(f"md5sum {' '.join(FILES)}").check().output
    return {line.split()[1]: line.split()[0] for line in out.splitlines() if len(line.split()) == 2}


@pytest.fixture
def files(target: qprobe.Target, qprobe_reset: object) -> Iterator[None]:
    """The files in the dentry cache (as a user's shell has them); unchanged at the end."""
    target.run(f"ls {' '.join(FILES)} >/dev/null").check()
    before = md5(target)
    assert set(before) == set(FILES)
    yield
    assert md5(target) == before


def summary(output: str, prefix: str = "uprog mode=") -> dict[str, str]:
    line = next((x for x in output.splitlines() if x.startswith(prefix)), None)
    assert line is not None, output
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


def ok(output: str, prefix: str = "uprog mode=") -> dict[str, str]:
    """The summary of a run that exited 0 with bad=0 (the command appends ``rc=$?``)."""
    res = summary(output, prefix)
    assert res["bad"] == "0" and re.search(r"^rc=0$", output, re.M), output
    return res


def run(target: qprobe.Target, command: str) -> str:
    return target.run(f"{command}; echo rc=$?").check().output


def background(target: qprobe.Target, command: str, out: str) -> None:
    target.run(f"rm -f {out}; ({command}; echo rc=$?) > {out} 2>&1 &").check()


def collect(target: qprobe.Target, out: str, timeout: float = 300) -> str:
    """The output of a background command once it ended (its rc= line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = target.run(f"cat {out} 2>/dev/null").output
        if re.search(r"^rc=\d+$", text, re.M):
            return text
        target.wait(0.5)
    raise AssertionError(f"{out} never ended")


def wait_for(target: qprobe.Target, out: str, pattern: str, timeout: float = 120) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, target.run(f"cat {out} 2>/dev/null").output, re.M)
        if m:
            return m
        target.wait(0.2)
    raise AssertionError(f"{pattern!r} never in {out}")


def by_pid(target: qprobe.Target, counter: Counter[int]) -> Callable[[Uprobe, qprobe.PtRegs], None]:
    def handler(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        counter[target.current_task(regs).pid] += 1

    return handler


# -- qprobe killed with uprobes armed: first, so no VM of the module's fixture runs beside its own ----------

PROBER = textwrap.dedent(
    """
    import sys, time, qprobe
    t = qprobe.attach(sys.argv[1])
    t.run("ls /bin/uprog-static >/dev/null").check()
    up = qprobe.Uprobe("/bin/uprog-static", int(sys.argv[2]), in_guest=None if sys.argv[3] == "guest" else False)
    t.register_uprobe(up)
    t.run(f"rm -f /tmp/kill.out; (uprog-static call {sys.argv[4]} 1 2 kill; echo rc=$?) > /tmp/kill.out 2>&1 &").check()
    while up.nhit < 5:
        time.sleep(0.05)
    print("ARMED", up.nhit, flush=True)
    while True:
        time.sleep(1)
    """
)


def static_address(symbol: str) -> int:
    elf = lief.parse(str(guest_tree() / STATIC.lstrip("/")))
    assert elf is not None
    return int(elf.get_symbol(symbol).value)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _qemu_child(owner: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == owner and b"qemu-system" in argv0:
                return int(entry.name)
    raise AssertionError(f"no QEMU started by {owner}")


@pytest.mark.parametrize(("via", "path"), [("cli", "stub"), ("target", "stub"), ("target", "guest")])
def test_qprobe_killed_with_uprobes_armed_leaves_the_vm_usable(off: dict[str, int], via: str, path: str) -> None:
    """The next ``qprobe attach``, or a Target attached at once, finds the VM usable and the program ends well.

    The dead qprobe's breakpoint is in QEMU on every vCPU; a connect's ``?`` takes out vCPU 0's only, so the
    program is run on each vCPU in turn: a breakpoint left on any of them stops it there.  Counted in the
    guest ("guest", where the kernel can), the probe is the kernel's, with qprobe's consumer: the attach
    unregisters it, and the running program's text has the original bytes again.
    """
    calls = 2_000_000 if path == "guest" else 400  # a program still calling when the prober is killed
    boot = subprocess.Popen([sys.executable, "-m", "qprobe.cli", "boot", "--image", IMAGE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        address = readline_matching(boot, r"attach with:\s+qprobe attach (\S+)").group(1)
        qemu = _qemu_child(boot.pid)
        prober = subprocess.Popen([sys.executable, "-c", PROBER, address, str(off[STATIC]), path, str(calls)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
        try:
            readline_matching(prober, "ARMED")
        finally:
            os.kill(prober.pid, signal.SIGKILL)
            prober.wait()
        # What QEMU does with a dead client's breakpoints: the program runs into one with nobody to tell,
        # and the VM stops there (RUN_STATE_DEBUG) until a client comes: QEMU's CPU time stands still.
        time.sleep(2)
        before = _cpu_ticks(qemu)
        time.sleep(3)
        idle = _cpu_ticks(qemu) - before
        print(f"QEMU CPU ticks in 3 s after the kill: {idle}")
        if via == "cli":
            cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", address], capture_output=True,
                                 text=True, cwd=ROOT, timeout=300)  # fmt: skip
            assert cli.returncode == 0, cli.stderr
        with qprobe.attach(address) as t:
            # No breakpoint of the dead qprobe is left in QEMU: a stop at the static program's address
            # (the same in every process), where this qprobe has none, would be one.  Each is counted and
            # stepped past (left alone, the vCPU would stop there again at every resume).
            stale: Counter[str] = Counter()
            va = static_address("qpt_target")

            def seen(tid: str, _regs: dict[str, int]) -> None:
                stale[tid] += 1
                t.machine.gdb.step(tid)

            t.machine.call(lambda: t.machine.stop_handlers.__setitem__(va, seen))
            try:
                out = collect(t, "/tmp/kill.out")
                res = ok(out)
                assert res["calls"] == str(calls), out
                ncpus = int(t.run("grep -c ^processor /proc/cpuinfo").check().output)
                for cpu in range(ncpus):
                    each = summary(t.run(f"taskset {1 << cpu:#x} uprog-static call 50 1 1 t").check().output)["calls"]
                    assert each == "50", cpu
                # A process started now has the file's own first byte of the function (no kernel int3 left).
                background(t, "uprog-static wait-then-call 3 1", "/tmp/w.out")
                pid = wait_for(t, "/tmp/w.out", r"^uprog pid=(\d+)")[1]
                first = t.run(f"dd if=/proc/{pid}/mem bs=1 skip={va} count=1 2>/dev/null | od -An -tx1").check()
                assert int(first.output, 16) == (guest_tree() / STATIC.lstrip("/")).read_bytes()[off[STATIC]]
            finally:
                t.machine.call(lambda: t.machine.stop_handlers.pop(va))
            print(f"stops at the dead qprobe's breakpoint, by vCPU: {dict(stale)}")
            assert not stale
            up = Uprobe(STATIC, off[STATIC])
            t.register_uprobe(up)  # the VM is usable for uprobes again
            try:
                res = ok(run(t, "uprog-static call 3 1 2 again"))
            finally:
                t.unregister_uprobe(up)
            assert up.nhit == int(res["calls"]) == 3
            assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]
    finally:
        boot.send_signal(signal.SIGINT)
        try:
            boot.wait(60)
        finally:
            if boot.poll() is None:
                boot.kill()


# -- semantics users expect ----------------------------------------------------------------------------------


def test_a_process_already_running(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """Registered while the process sleeps: its program and its shared library are probed, every call."""
    exe, lib = Counter[int](), Counter[int]()
    background(target, "uprog wait-then-call 3 7", "/tmp/w.out")
    pid = int(wait_for(target, "/tmp/w.out", r"^uprog pid=(\d+) target=")[1])
    ups = [Uprobe(PROG, off[PROG], handler=by_pid(target, exe)), Uprobe(LIB, off[LIB], handler=by_pid(target, lib))]
    for up in ups:
        target.register_uprobe(up)
    try:
        res = ok(collect(target, "/tmp/w.out"))
    finally:
        for up in ups:
            target.unregister_uprobe(up)
    assert int(res["pid"]) == pid
    assert exe == {pid: int(res["calls"])} and lib == {pid: int(res["lib_calls"])}, (exe, lib, res)
    assert int(res["calls"]) == 7


def test_processes_started_later_and_forked_children(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``fork 3 4``: parent (k=0) and children (k=1..3) each make 4 calls; each is attributed to its pid."""
    seen: defaultdict[int, list[int]] = defaultdict(list)

    def handler(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        seen[target.current_task(regs).pid].append(regs.si)

    for prog in (PROG, STATIC):
        seen.clear()
        up = Uprobe(prog, off[prog], handler=handler)
        target.register_uprobe(up)
        try:
            out = run(target, f"{prog} fork 3 4")
        finally:
            target.unregister_uprobe(up)
        res = ok(out)
        expected = {int(res["pid"]): [0] * int(res["m"])}  # its calls= counts the children's too
        for line in out.splitlines():
            if line.startswith("uprog-child "):
                child = ok(line + "\nrc=0", "uprog-child ")
                expected[int(child["pid"])] = [int(child["k"])] * int(child["calls"])
        assert len(expected) == 4 and res["crashed"] == "0", out
        assert dict(seen) == expected, (prog, out)
        assert up.nhit == sum(len(v) for v in expected.values()) == int(res["calls"])


def test_threads(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``threads 3 5``: thread k = 1..3's entries and returns, paired per task (a + b: i + k)."""
    entries: defaultdict[int, list[int]] = defaultdict(list)
    returns: defaultdict[int, list[int]] = defaultdict(list)

    def entry(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        entries[target.current_task(regs).pid].append(regs.di + regs.si)

    def ret(_up: Uprobe, _func: int, regs: qprobe.PtRegs) -> None:
        returns[target.current_task(regs).pid].append(regs_return_value(regs))

    up = Uprobe(PROG, off[PROG], handler=entry, ret_handler=ret)
    target.register_uprobe(up)
    try:
        res = ok(run(target, "uprog threads 3 5"))
    finally:
        target.unregister_uprobe(up)
    assert int(res["calls"]) == 15 and up.nhit == up.nreturns == 15, res
    assert len(entries) == 3 and sorted(sorted(v) for v in entries.values()) == [
        [i + k for i in range(5)] for k in range(1, 4)
    ]
    assert dict(returns) == dict(entries)


def test_a_shared_library_in_two_processes_at_once(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    pids = Counter[int]()
    up = Uprobe(LIB, off[LIB], handler=by_pid(target, pids))
    target.register_uprobe(up)
    try:
        out = run(
            target, "uprog lib 6 > /tmp/l1.out & uprog lib 9 5 5 > /tmp/l2.out & wait; cat /tmp/l1.out /tmp/l2.out"
        )
    finally:
        target.unregister_uprobe(up)
    lines = [x for x in out.splitlines() if x.startswith("uprog mode=lib")]
    assert len(lines) == 2, out
    res = [summary(x) for x in lines]
    assert all(r["bad"] == "0" for r in res)
    assert pids == {int(r["pid"]): int(r["calls"]) for r in res}, (pids, out)
    assert sorted(int(r["calls"]) for r in res) == [6, 9]


def test_recursion_with_a_return_probe(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``recurse 12``: 13 entries d = 12..0 and 13 returns 0..12, every one the function's own (paired)."""
    entries: list[int] = []
    returns: list[tuple[int, int]] = []
    tasks: set[int] = set()

    def ret(_up: Uprobe, func: int, regs: qprobe.PtRegs) -> None:
        tasks.add(target.current_task(regs).pid)
        returns.append((func, regs_return_value(regs)))

    up = Uprobe(PROG, off["recurse"], handler=lambda _u, r: entries.append(r.di), ret_handler=ret)
    rp = Uretprobe(PROG, off["recurse"])
    target.register_uprobe(up)
    target.register_uprobe(rp)
    try:
        res = ok(run(target, "uprog recurse 12"))
    finally:
        target.unregister_uprobe(up)
        target.unregister_uprobe(rp)
    depth = 12
    assert int(res["calls"]) == depth + 1
    assert entries == list(range(depth, -1, -1))
    assert [r for _f, r in returns] == list(range(depth + 1)) and len({f for f, _r in returns}) == 1
    assert up.nreturns == rp.nreturns == depth + 1 and up.nmissed == rp.nmissed == 0
    assert tasks == {int(res["pid"])}
    assert not target.uprobes.returns.by_task and not target.uprobes.points


def test_exec_of_the_same_file(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``exec 4``: 4 calls before the exec and 4 after it, in the same pid, the new image mapped anew."""
    tags: Counter[tuple[int, bytes]] = Counter()

    def handler(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        tags[(target.current_task(regs).pid, regs.read(regs.dx, 16).split(b"\0")[0])] += 1

    up = Uprobe(PROG, off[PROG], handler=handler)
    target.register_uprobe(up)
    try:
        out = run(target, "uprog exec 4")
    finally:
        target.unregister_uprobe(up)
    pre = ok(out, "uprog-exec ")
    post = ok(out)
    assert pre["pid"] == post["pid"] and post["s"] == "exec", out
    pid = int(pre["pid"])
    assert tags == {(pid, b"pre-exec"): int(pre["calls"]), (pid, b"exec"): int(post["calls"])}, tags


def test_the_file_mapped_a_second_time(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``remap 5``: the calls through the second mapping are hits, at its own address."""
    ips = Counter[int]()
    up = Uprobe(PROG, off[PROG], handler=lambda _u, regs: ips.update([regs.ip]))
    target.register_uprobe(up)
    try:
        res = ok(run(target, "uprog remap 5"))
    finally:
        target.unregister_uprobe(up)
    assert res["offset"] == hex(off[PROG]), res
    assert ips == {int(res["alias"], 16): int(res["calls"])} and int(res["calls"]) == 5


def test_a_private_copy_of_the_text_page(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """``selfmod 5``: the program writes its own text (mprotect, copy-on-write); the probe stays in its mm."""
    up = Uprobe(PROG, off[PROG])
    target.register_uprobe(up)
    try:
        res = ok(run(target, "uprog selfmod 5"))
        again = ok(run(target, "uprog call 2 1 1 after"))
    finally:
        target.unregister_uprobe(up)
    assert int(res["calls"]) == 5 and up.nhit == 5 + int(again["calls"]), (res, up)


def test_page_cache_eviction_between_runs(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    pids = Counter[int]()
    ups = [Uprobe(PROG, off[PROG], handler=by_pid(target, pids)), Uprobe(LIB, off[LIB], handler=by_pid(target, pids))]
    for up in ups:
        target.register_uprobe(up)
    try:
        first = ok(run(target, "uprog call 3 1 1 a"))
        target.run("sync; echo 3 > /proc/sys/vm/drop_caches").check()
        second = ok(run(target, "uprog lib 4"))
        target.run("sync; echo 3 > /proc/sys/vm/drop_caches").check()
        third = ok(run(target, "uprog call 2 1 1 b"))
    finally:
        for up in ups:
            target.unregister_uprobe(up)
    assert pids == {int(r["pid"]): int(r["calls"]) for r in (first, second, third)}, pids


def test_registered_and_unregistered_while_the_program_runs(
    target: qprobe.Target, files: None, off: dict[str, int]
) -> None:
    # Enough calls that the program is still calling when the probe goes: a hit is one VM stop, some
    # milliseconds, and the host polls and unregisters within a fraction of a second.  (Counted in the
    # guest, a hit costs the kernel's own: test_uprobe_inguest.py.)
    calls = 2000
    up = Uprobe(PROG, off[PROG], in_guest=False)
    background(target, f"uprog wait-then-call 1 {calls}", "/tmp/ru.out")
    wait_for(target, "/tmp/ru.out", r"^uprog pid=")
    target.register_uprobe(up)
    deadline = time.monotonic() + 120
    while up.nhit < 3 and time.monotonic() < deadline:
        target.wait(0.05)
    target.unregister_uprobe(up)
    assert not target.uprobes.points
    res = ok(collect(target, "/tmp/ru.out"))
    assert 3 <= up.nhit < int(res["calls"]) == calls, (up, res)


def test_filters_by_pid_and_by_comm(target: qprobe.Target, files: None, off: dict[str, int]) -> None:
    """Two processes of the same file: the filter lets one pid's calls (or one comm's) through."""
    background(target, "uprog wait-then-call 2 4", "/tmp/f1.out")
    background(target, "uprog wait-then-call 2 6", "/tmp/f2.out")
    first = int(wait_for(target, "/tmp/f1.out", r"^uprog pid=(\d+)")[1])
    wait_for(target, "/tmp/f2.out", r"^uprog pid=")
    by_pid_up = Uprobe(PROG, off[PROG], filter=lambda _u, regs: target.current_task(regs).tgid == first)
    target.register_uprobe(by_pid_up)
    try:
        r1, r2 = ok(collect(target, "/tmp/f1.out")), ok(collect(target, "/tmp/f2.out"))
    finally:
        target.unregister_uprobe(by_pid_up)
    assert (by_pid_up.nhit, by_pid_up.nfiltered) == (int(r1["calls"]), int(r2["calls"])) == (4, 6)

    # comm is the name the program was run by: a link to the same file is the same inode, another comm.
    by_comm = Uprobe(PROG, off[PROG], filter=lambda _u, regs: target.current_task(regs).comm == "qptcomm")
    target.run("ln -sf /bin/uprog /tmp/qptcomm").check()
    target.register_uprobe(by_comm)
    try:
        mine = ok(run(target, "/tmp/qptcomm call 5 1 1 c"))
        other = ok(run(target, "uprog call 7 1 1 c"))
    finally:
        target.unregister_uprobe(by_comm)
        target.run("rm -f /tmp/qptcomm")
    assert (by_comm.nhit, by_comm.nfiltered) == (int(mine["calls"]), int(other["calls"])) == (5, 7)
