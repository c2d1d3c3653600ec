"""The interactive shell on the real kernel: Shell.execute driven line by line, and `qprobe shell` in a pty."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import qprobe
from qprobe.shell import Shell

from .conftest import IMAGE, disassemble, entry_offset, vmlinux_of
from .conftest import shell_do as do

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the QEMU a qprobe process started, in its own session)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


# The pty test comes first: the module's `target` VM is not booted yet, so only one QEMU runs at a time.
def test_qprobe_shell_in_a_pty_exits_0_on_ctrl_d() -> None:
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", NO_COLOR="1", PYTHONPATH=str(ROOT))
    child = pexpect.spawn(sys.executable, ["-m", "qprobe.cli", "shell", "--image", IMAGE], cwd=str(ROOT), env=env,
                          encoding="utf-8", timeout=300, dimensions=(50, 200))  # fmt: skip
    qemus: list[int] = []
    try:
        child.expect_exact("qprobe>", timeout=600)  # the boot (prompt_toolkit draws the space as a cursor move)
        qemus = _children(child.pid)
        child.sendline("sym vfs_read")
        child.expect(r"vfs_read\s+0xffffffff[0-9a-f]{8}\s+size 0x[0-9a-f]+")
        child.expect_exact("qprobe>")
        child.sendline("p:gp __x64_sys_getppid")
        child.expect_exact("added kprobes/gp")
        child.sendline("count gp by $comm run workload getppid 3")
        child.expect_exact("@[workload]: 3")
        child.expect_exact("qprobe>")
        # Ctrl-C ends a count that waits for it, and the shell goes on.
        child.sendline("count gp")
        child.expect_exact("Ctrl-C to stop")  # printed once the count is armed
        child.sendintr()
        child.expect_exact("no hits")
        child.expect_exact("qprobe>")
        child.sendline("p:bad vfs_read x=%zz")
        child.expect(r"\^ .{0,20}Invalid register name")
        child.expect_exact("qprobe>")
        child.sendcontrol("d")
        child.expect(pexpect.EOF, timeout=120)
        child.close()
        assert child.exitstatus == 0, child.before
        assert not [pid for pid in qemus if Path(f"/proc/{pid}").exists()], "QEMU outlived `qprobe shell`"
    finally:
        if child.isalive():
            child.kill(signal.SIGTERM)  # qprobe removes its probes and stops QEMU on SIGTERM
            deadline = time.monotonic() + 60
            while child.isalive() and time.monotonic() < deadline:
                time.sleep(0.5)
            if child.isalive():
                child.kill(signal.SIGKILL)
        for pid in qemus:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def shell(target: qprobe.Target, guard: dict[int, bytes]) -> Iterator[tuple[Shell, io.StringIO]]:
    out = io.StringIO()
    sh = Shell(target, out=out)
    try:
        yield sh, out
    finally:
        for te in list(target.events.values()):
            target.remove_event(te)


def test_shell_session(target: qprobe.Target, shell: tuple[Shell, io.StringIO]) -> None:
    sh, out = shell
    assert do(sh, out, "p:gp __x64_sys_getppid") == "added kprobes/gp  (probe on __x64_sys_getppid)\n"
    text = do(sh, out, "run workload getppid 5")
    assert "workload mode=getppid n=5 " in text and text.endswith("exit status 0\n")
    stats = do(sh, out, "stats").splitlines()
    assert stats[0].split() == ["EVENT", "HITS", "NMISSED", "LOST", "HITS/S"]
    assert stats[1].split()[:4] == ["kprobes/gp", "5", "0", "0"]

    text = do(sh, out, "count gp by $comm run workload getppid 5")
    assert "@[workload]: 5" in text.splitlines(), text

    assert do(sh, out, "p:rd ksys_read count=%dx:u64").startswith("added kprobes/rd")
    text = do(sh, out, "hist rd by count run workload read 5 3000")
    assert "@count: " in text.splitlines()
    assert re.search(r"^\[2K, 4K\)\s+5 \|@+ *\|$", text, re.M), text

    # Where the guest kernel would put each probe: past an ENDBR on a kernel built with IBT.
    vmlinux = vmlinux_of(target)
    gp_at, rd_at = entry_offset(vmlinux, "__x64_sys_getppid"), entry_offset(vmlinux, "ksys_read")
    listing = do(sh, out, "list")
    assert re.search(rf"^[0-9a-f]{{16}}  k  __x64_sys_getppid\+{gp_at:#x}\b", listing, re.M), listing
    assert re.search(rf"^[0-9a-f]{{16}}  k  ksys_read\+{rd_at:#x}\b", listing, re.M), listing
    assert do(sh, out, "events") == "p:kprobes/gp __x64_sys_getppid\np:kprobes/rd ksys_read count=%dx:u64\n"

    lines = do(sh, out, "show gp run workload getppid 2").splitlines()
    hits = [line for line in lines if f": gp: (__x64_sys_getppid+{gp_at:#x}/" in line]
    assert len(hits) == 2 and all(line.lstrip().startswith("workload-") for line in hits), lines

    assert do(sh, out, "-:gp").startswith("removed kprobes/gp (")
    assert do(sh, out, "-:rd").startswith("removed kprobes/rd (")
    assert not target.events and not target.kprobes.points

    dump = do(sh, out, "x linux_banner 32")
    assert "Linux version" in dump and dump.startswith(f"{target.symbols.address('linux_banner'):016x}: 4c69 6e75")
    sym = target.symbols.lookup("vfs_read")
    assert do(sh, out, "sym vfs_read").startswith(f"vfs_read  {sym.addr:#018x}  size {sym.size:#x} ({sym.size})  func")
    assert do(sh, out, "addr vfs_read+5") == f"{sym.addr + 5:#018x}  vfs_read+0x5/{sym.size:#x}  func\n"


def test_bad_definition_gets_a_caret_and_the_shell_goes_on(target: qprobe.Target,
                                                           shell: tuple[Shell, io.StringIO]) -> None:  # fmt: skip
    sh, out = shell
    before = dict(target.journal.patches)
    assert do(sh, out, "p:bad vfs_read x=%zz") == "p:bad vfs_read x=%zz\n" + " " * 17 + "^ Invalid register name\n"
    # Refused when registering: the kernel's text under a caret, qprobe's reason after it.  An offset
    # from +3 on inside an instruction, as binutils decodes the image's vmlinux (+3 inside a call to
    # __fentry__ or an ENDBR; a kernel with neither can have a boundary there), and the boundaries
    # either side of it.
    offsets = [off for off, *_ in disassemble(vmlinux_of(target), "vfs_read")]
    inside = next(off for off in range(3, offsets[-1]) if off not in offsets)
    below, above = max(off for off in offsets if off < inside), min(off for off in offsets if off > inside)
    assert do(sh, out, f"p:bad vfs_read+{inside}") == (
        f"p:bad vfs_read+{inside}\n      ^ Probe point is not an instruction boundary: "
        f"vfs_read+{inside:#x} is not an instruction boundary (nearest: +{below:#x} and +{above:#x})\n"
    )
    assert target.journal.patches == before and not target.events and not sh.done
    assert do(sh, out, "r:rr ksys_read ret=$retval:s64").startswith("added kprobes/rr  (return probe")
    assert "@[100]: 3" in do(sh, out, "count rr by ret run workload read 3 100").splitlines()
    assert do(sh, out, "-:rr") == "removed kprobes/rr (3 hits)\n"


def _ctrl_c_when(ready: Callable[[], object]) -> threading.Thread:
    """SIGINT to the main thread (as Ctrl-C would) as soon as ``ready()`` holds; started, to be joined.

    Sent even when ``ready()`` fails, so the command it is meant to stop ends and the test fails
    rather than waits for ever.  Python's own SIGINT handler is put back first: a run started in
    the background of a non-interactive shell inherits SIGINT ignored.
    """
    main = threading.main_thread().ident
    assert main is not None
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def wait_then_interrupt() -> None:
        try:
            ready()
        finally:
            signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=wait_then_interrupt)
    thread.start()
    return thread


def _guest_printed(target: qprobe.Target, pattern: str) -> Callable[[], object]:
    """Waits until the guest shell's port shows ``pattern`` after what it shows now."""
    shell = target.guest_shell
    assert shell is not None
    start = shell.port.end
    return lambda: shell.port.wait_for(pattern, 300, start)


def test_ctrl_c_stops_a_count_and_a_guest_command_not_the_shell(target: qprobe.Target,
                                                                shell: tuple[Shell, io.StringIO]) -> None:  # fmt: skip
    sh, out = shell
    do(sh, out, "p:gp __x64_sys_getppid")

    def counting_then_workload() -> None:
        deadline = time.monotonic() + 60
        while "Ctrl-C to stop" not in out.getvalue():  # the count is armed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        target.run("workload getppid 3", timeout=300)  # its hits are all counted when run() returns

    helper = _ctrl_c_when(counting_then_workload)
    text = do(sh, out, "count gp by $comm")  # until Ctrl-C
    helper.join(60)
    assert "@[workload]: 3" in text.splitlines(), text
    assert target.events["kprobes/gp"].callback is None

    # Ctrl-C once the guest runs the command: the shell's wait for it ends at once.
    helper = _ctrl_c_when(_guest_printed(target, r"@@qp-begin-[0-9a-f]+@@\n"))
    t0 = time.monotonic()
    text = do(sh, out, "run sleep 60")
    helper.join()
    assert time.monotonic() - t0 < 30 and "interrupted: sent ^C to the guest command" in text
    assert do(sh, out, "run echo still-here").startswith("still-here\n")

    # The same for a count over a guest command (Ctrl-C in its sleep): the count prints, the console is free at once.
    helper = _ctrl_c_when(_guest_printed(target, r"workload mode=getppid n=4 .*\n"))
    t0 = time.monotonic()
    text = do(sh, out, "count gp by $comm run workload getppid 4; sleep 60")
    helper.join()
    assert "interrupted: sent ^C to the guest command" in text and "@[workload]: 4" in text.splitlines(), text
    assert do(sh, out, "run echo again").startswith("again\n") and time.monotonic() - t0 < 30
    assert do(sh, out, "-:gp").startswith("removed kprobes/gp")


def test_gdb_static_command_on_vmlinux(target: qprobe.Target, shell: tuple[Shell, io.StringIO]) -> None:
    sh, out = shell
    text = do(sh, out, "gdb info line vfs_read")
    assert f"{target.symbols.address('vfs_read'):#x} <vfs_read>" in text, text
    if not callable(getattr(target.gdb, "console", None)):
        assert do(sh, out, "gdb info registers").startswith("error: live-target gdb commands need the gdb transport")


def test_stack_counts_and_bt(target: qprobe.Target, shell: tuple[Shell, io.StringIO]) -> None:
    sh, out = shell
    do(sh, out, "p:gp __x64_sys_getppid")
    text = do(sh, out, "count gp by $stack run workload getppid 3")
    # bpftrace's kstack key: one frame per line, 8 spaces in, decimal offsets; the syscall path under the probe.
    frame = r"\n {8}"
    # (6.12 has the alias __ia32_sys_getppid at the same address: drgn may name the function by either.)
    # Since 6.9 (1e3ad78334a6, "x86/syscall: Don't force use of indirect calls for system calls")
    # do_syscall_64 calls through x64_sys_call, a frame the frame-pointer unwinder shows.
    stack = (rf"^@\[{frame}__(?:x64|ia32)_sys_getppid\+\d+(?:{frame}x64_sys_call\+\d+)?{frame}do_syscall_64\+\d+"
             rf"(?:{frame}\S+)*\n\]: 3$")  # fmt: skip
    assert re.search(stack, text, re.M), text
    assert do(sh, out, "-:gp").startswith("removed kprobes/gp")
    frames = do(sh, out, "bt 0").splitlines()
    # drgn's trace: a C function with its file:line, or entry code as symbol+offset/size.
    frame_line = r"#\d+ +(?:\w+ \(\S+\.[chS]:\d+(?::\d+)?\)|\w+\+0x[0-9a-f]+/0x[0-9a-f]+(?: \(\S+\))?)"
    assert frames and all(re.fullmatch(f"{frame_line}|vCPU 0 is in user mode.*", f) for f in frames), frames


def test_bpftrace_maps_on_what_the_workload_did(target: qprobe.Target, shell: tuple[Shell, io.StringIO]) -> None:
    """sum, stats, lhist and max by keys of several parts, against the reads the workload made (read N SIZE:
    N reads of SIZE bytes from /dev/zero), and `every` printing and clearing while the guest runs."""
    sh, out = shell
    assert do(sh, out, "p:rd ksys_read fd=%di:s32 count=%dx:u64").startswith("added kprobes/rd")
    text = do(sh, out, "sum(count) rd by $comm, fd run workload read 5 3000")
    pid = workload_pid(text)
    fd = 3  # the workload's first open file (stdin, stdout, stderr before it)
    assert f"@count[workload, {fd}]: 15000" in text.splitlines(), text
    text = do(sh, out, "stats(count) rd by $comm, $pid run workload read 4 100")
    assert f"@count[workload, {workload_pid(text)}]: count 4, average 100, total 400" in text.splitlines(), text
    text = do(sh, out, "lhist(count, 0, 4096, 1024) rd by $comm run workload read 3 1500; workload read 2 5000")
    rows = text.splitlines()
    at = rows.index("@count[workload]: ")
    assert rows[at + 1].split() == ["[1K,", "2K)", "3", "|" + "@" * 52 + "|"], rows
    assert rows[at + 2 : at + 4] == [f"{'[2K, 3K)':<16}{0:>8} |{' ' * 52}|", f"{'[3K, 4K)':<16}{0:>8} |{' ' * 52}|"]
    assert rows[at + 4].split()[:3] == ["[4K,", "...)", "2"], rows
    assert pid > 0
    # every S prints the map and clears it: the workload's hits, spread over the prints, add up to what it did.
    text = do(sh, out, "count rd by $comm every 0.2 run workload read 3 10; sleep 1; workload read 4 10")
    printed = [int(line.split(": ")[1]) for line in text.splitlines() if line.startswith("@[workload]: ")]
    assert sum(printed) == 7 and len(printed) >= 2, text
    # format: how show prints an event's hits, bpftrace's printf.
    assert do(sh, out, r'format rd "%s:%d:%5d|\n", $comm, fd, count').startswith("kprobes/rd: printf ")
    lines = do(sh, out, "show rd run workload read 2 77").splitlines()
    assert [x for x in lines if x.startswith("workload:")] == ["workload:3:   77|"] * 2, lines
    assert do(sh, out, "format rd").startswith("kprobes/rd: ftrace lines")


def workload_pid(text: str) -> int:
    line = next(x for x in text.splitlines() if x.startswith("workload "))
    return int(dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)["pid"])
