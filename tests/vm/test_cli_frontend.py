"""The command line as bpftrace users drive it: -c (--run), printf (--format), JSON numbers, boot --detach.

Expected values come from what the guest workload does (``workload read N SIZE``: N
reads of SIZE bytes; ``workload getppid N``: N getppid calls) and from the shell's
own semantics (a compound command runs in the subshell that ``--run`` forks).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qprobe
from qprobe.images import get_image
from qprobe.paths import cache_dir

from .conftest import IMAGE, entry_offset

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def _qprobe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def test_run_is_bpftrace_c_the_commands_processes_its_pid_and_its_exit_status() -> None:
    # The subshell --run forks is $cpid; it forks each workload, so none of their getppid calls is its own.
    cmd = "workload getppid 3; workload getppid 2; exit 3"
    out = _qprobe("trace", "--image", IMAGE, "--json", "--run", cmd, "--filter", "common_pid != $cpid",
                  "p:gp __x64_sys_getppid", "p:other __x64_sys_getppid")  # fmt: skip
    assert out.returncode == 3, out.stderr  # the command's exit status
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    hits, summary = rows[:-1], rows[-1]["summary"]
    assert len(hits) == 10 and {h["comm"] for h in hits} == {"workload"}, hits
    assert len({h["pid"] for h in hits}) == 2  # two workload processes
    assert summary["gp"]["hits"] == 5 and summary["gp"]["nmissed"] == 0, summary
    assert "mode=getppid n=3" in out.stderr and "mode=getppid n=2" in out.stderr
    out = _qprobe("trace", "--image", IMAGE, "--run", cmd, "--filter", "common_pid == $cpid", "p:gp __x64_sys_getppid")
    assert out.returncode == 3 and out.stdout.splitlines() == ["# gp: hits=0 nmissed=0 lost=0 others=0 filtered=5"], (
        out.stdout
    )


def test_format_prints_each_hit_with_printf_and_json_numbers_are_numbers() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--run", "workload read 3 100", "--format",
                  r'"%s read %d bytes from fd %d\n", $comm, count, fd',
                  "p:rd ksys_read fd=%di:s32 count=%dx:u64")  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # Exactly the command's: not the guest shell's reads of the command line.
    assert lines[:-1] == ["workload read 100 bytes from fd 3"] * 3, lines
    assert lines[-1].startswith("# rd: hits=3 "), lines
    out = _qprobe("trace", "--image", IMAGE, "--json", "--run", "workload read 2 4096",
                  "p:rd ksys_read fd=%di:s32 count=%dx:x64 comm=$comm:string")  # fmt: skip
    assert out.returncode == 0, out.stderr
    hits = [json.loads(line) for line in out.stdout.splitlines()][:-1]
    assert [h["args"] for h in hits] == [{"fd": 3, "count": 4096, "comm": "workload"}] * 2, hits
    bad = _qprobe("trace", "--format", '"%d %d\\n", count', "p:rd ksys_read count=%dx:u64")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "qprobe: error: printf: the format has 2 conversions and 1 values follow it"
    ]


def _detached_boot() -> tuple[str, int]:
    """A VM booted in the background: its gdbstub's address and the pid that owns it."""
    out = _qprobe("boot", "--image", IMAGE, "--detach", timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    sock = next(x.split("qprobe attach ", 1)[1] for x in lines if x.startswith("attach with:"))
    return sock, int(lines[-1].split()[-1])


def _guest(sock: str, *commands: str) -> list[str]:
    """The output of each guest command, run through one attach."""
    with qprobe.attach(sock) as t:
        return [t.run(command).check().output for command in commands]


def _traced(sock: str, command: str, *definitions: str) -> tuple[list[dict], dict[str, dict[str, int]], str]:
    """``trace --run COMMAND``'s hits, summary rows and the command's output (on stderr)."""
    out = _qprobe("trace", "--attach", sock, "--json", "--run", command, *definitions)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    return rows[:-1], rows[-1]["summary"], out.stderr


def _reads_of_dd(output: str) -> list[int]:
    """The read calls of each dd, from its own report: one a record ("FULL+PARTIAL records in"), one at EOF."""
    return [int(full) + int(partial) + 1 for full, partial in re.findall(r"^(\d+)\+(\d+) records in$", output, re.M)]


def test_run_counts_the_command_from_its_fork_applets_builtins_pipelines_and_programs() -> None:
    """Busybox runs an applet, and the shell a builtin, in the command's process without an exec: its hits
    count all the same, from the fork of that process; the guest shell's (reading the line) never do."""
    sock, owner = _detached_boot()
    try:
        shell, size, first_line = (int(out.split()[-1]) for out in _guest(
            sock, "echo $$", "wc -c < /proc/version", "head -n 1 /proc/version | wc -c"))  # fmt: skip

        # An applet: dd's reads, one a record and the one that sees the end, as dd counts them.
        hits, summary, output = _traced(sock, "dd if=/proc/version of=/dev/null bs=16", "p:rd vfs_read")
        assert _reads_of_dd(output) == [summary["rd"]["hits"]] and len(hits) == summary["rd"]["hits"], output
        assert shell not in {h["pid"] for h in hits} and summary["rd"]["others"] > 0, (hits, summary)

        # cat reads the file's bytes, each once, and then its end.  Busybox's cat copies with sendfile
        # (read() where that fails), so what it reads is counted where both read /proc files.
        hits, summary, output = _traced(sock, "cat /proc/version", "r:rd seq_read_iter ret=$retval:s64")
        returned = [h["args"]["ret"] for h in hits]
        assert sum(returned) == size and min(returned) == 0, returned
        assert len({h["pid"] for h in hits}) == 1 and summary["rd"]["hits"] == len(hits)

        # A builtin: the shell's read takes a byte a read, so as not to read past the line's end.
        hits, summary, _ = _traced(sock, "read -r line < /proc/version", "p:rd vfs_read")
        assert summary["rd"]["hits"] == first_line and len({h["pid"] for h in hits}) == 1, (first_line, summary)

        # A pipeline: both of its processes' reads.
        hits, summary, output = _traced(sock, "dd if=/proc/version bs=16 | dd of=/dev/null bs=7", "p:rd vfs_read")
        reads = _reads_of_dd(output)
        assert len(reads) == 2 and summary["rd"]["hits"] == sum(reads), (output, summary)
        assert len({h["pid"] for h in hits}) == 2

        # A program, which the command's process execs.
        hits, summary, output = _traced(sock, "workload read 3 64 /etc/passwd", "p:rd vfs_read")
        assert "mode=read n=3 " in output and summary["rd"]["hits"] == 3, (output, summary)
        assert {h["comm"] for h in hits} == {"workload"}
    finally:
        os.kill(owner, signal.SIGTERM)
    _assert_gone_after_sigterm(sock)


def test_an_event_with_an_appended_probe_is_traced_and_removed_once() -> None:
    # The kernel's append rule: a second definition of the same event adds a probe to it.  One lseek
    # passes through both functions (the system call's wrapper calls ksys_lseek).
    out = _qprobe("trace", "--image", IMAGE, "--json", "--run", "workload lseek 1",
                  "p:x __x64_sys_lseek", "p:x ksys_lseek")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    hits, summary = rows[:-1], rows[-1]["summary"]
    assert [h["symbol"].split("+")[0] for h in hits] == ["__x64_sys_lseek", "ksys_lseek"], hits
    assert summary == {"x": {"hits": 2, "nmissed": 0, "lost": 0, "others": summary["x"]["others"]}}, summary
    assert "qprobe: error" not in out.stderr, out.stderr


def _child_qemu(parent: int, deadline: float) -> int:
    """The pid of the QEMU process ``parent`` started (waiting for it up to ``deadline``)."""
    while time.monotonic() < deadline:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (proc / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and b"qemu-system" in cmdline:
                return int(proc.name)
        time.sleep(0.2)
    raise AssertionError(f"process {parent} started no QEMU")


def test_trace_ends_when_its_vm_dies() -> None:
    """QEMU killed under a `trace` until Ctrl-C: one error line, a non-zero exit, no RAM file left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "p:l ksys_lseek"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        assert proc.stderr is not None
        qemu = _child_qemu(proc.pid, time.monotonic() + 300)
        ram = next(a.split("mem-path=")[1].split(",")[0] for a in Path(f"/proc/{qemu}/cmdline").read_text().split("\0")
                   if "mem-path=" in a)  # fmt: skip
        while "Ctrl-C to stop" not in proc.stderr.readline():
            assert proc.poll() is None, "trace ended before it was tracing"
        os.kill(qemu, signal.SIGKILL)
        # A bound on waiting, not on speed: before qprobe noticed a dead VM, trace slept until Ctrl-C.
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("qprobe: error: the VM is gone"), stderr
    assert stdout.splitlines()[-1].startswith("# l: hits="), stdout
    assert not Path(ram).exists() and not Path(ram).parent.exists()


def _assert_gone_after_sigterm(sock: str) -> None:
    """The detached VM whose owner was just sent SIGTERM goes, its socket with it."""
    deadline = time.monotonic() + 60  # a bound on waiting, not an assertion on speed
    while Path(sock.removeprefix("unix:")).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not Path(sock.removeprefix("unix:")).exists(), "the VM outlived its owner's SIGTERM"


def test_boot_detach_returns_and_the_vm_serves_attach_until_killed() -> None:
    out = _qprobe("boot", "--image", IMAGE, "--detach", timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    sock = next(x.split("qprobe attach ", 1)[1] for x in lines if x.startswith("attach with:"))
    owner = int(lines[-1].rsplit(" ", 1)[1])
    assert lines[-1] == f"the VM runs in the background; stop it with:  kill {owner}"
    try:
        listed = _qprobe("list", "--attach", sock)
        assert listed.returncode == 0 and listed.stdout == "", listed.stderr
        assert "no probes are armed" in listed.stderr
        armed = _qprobe("list", "--attach", sock, "p:vfs vfs_rea?")
        entry = entry_offset(get_image(IMAGE, fetch=False).vmlinux, "vfs_read")
        assert armed.returncode == 0 and re.search(rf"  vfs_read\+{entry:#x}\b", armed.stdout), armed.stderr
    finally:
        os.kill(owner, signal.SIGTERM)
    _assert_gone_after_sigterm(sock)


def test_trace_of_a_hot_loop_prints_every_hit_of_the_command() -> None:
    """100,000 reads in a tight loop: every one is a line, none lost (a full record ring makes the vCPU wait
    for qprobe instead of dropping); the ring's waits are said in the summary."""
    n = 100_000
    out = _qprobe("trace", "--image", IMAGE, "--run", f"workload read {n} 1", "p:rd ksys_read fd=%di:s32 count=%dx:u64")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("# rd: "))
    assert f"# rd: hits={n} nmissed=0 lost=0 " in summary + " ", summary
    line_of_the_command = re.compile(r"workload-\d+ .* rd: \(ksys_read\+0x\w+/0x\w+\) fd=3 count=1$")
    assert sum(1 for line in lines if line_of_the_command.search(line)) == n
    assert f"mode=read n={n} " in out.stderr


def test_trace_of_200000_lseeks_prints_each_offset_once_in_the_order_the_command_made_them() -> None:
    """``workload lseek N`` seeks to 1, 2, .. N: traced to a pipe, its lines (a ring's runs printed in bulk)
    are exactly N, one for each offset, in the command's order, none lost."""
    n = 200_000
    out = _qprobe("trace", "--image", IMAGE, "--run", f"workload lseek {n}",
                  "p:ls ksys_lseek fd=%di:u32 offset=%si:s64 whence=%dx:u32")  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("# ls: "))
    assert f"# ls: hits={n} nmissed=0 lost=0 " in summary + " ", summary
    line_of_the_command = re.compile(r"workload-\d+ .* ls: \(ksys_lseek\+0x\w+/0x\w+\) fd=\d+ offset=(\d+) whence=0$")
    offsets = [int(m.group(1)) for line in lines if (m := line_of_the_command.search(line))]
    assert len(offsets) == n and offsets == list(range(1, n + 1))
    assert f"mode=lseek n={n} " in out.stderr


def _syscall_text(sock: str) -> tuple[dict[str, bytes], int]:
    """The guest's text of every ``__x64_sys_*`` function, read from its memory through a fresh attach, and how
    many leftover patches that attach found in its undo journal and restored."""
    with qprobe.attach(sock) as t:
        names = [n for n in t.symbols.names() if fnmatch.fnmatchcase(n, "__x64_sys_*") and t.symbols.count(n) == 1]
        return {n: t.read(t.symbols.lookup(n).addr, t.symbols.lookup(n).size) for n in names}, t.recovered


def test_one_ctrl_c_ends_a_trace_of_hundreds_of_wildcard_events() -> None:
    """`qprobe trace 'p:sys __x64_sys_*'` (every syscall entry: several hundred events) on a running VM, then one
    SIGINT: it exits by itself with a summary row per event, status 130, and the guest's text as it was."""
    out = _qprobe("boot", "--image", IMAGE, "--detach", timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    sock = next(x.split("qprobe attach ", 1)[1] for x in lines if x.startswith("attach with:"))
    owner = int(lines[-1].rsplit(" ", 1)[1])
    try:
        before, _ = _syscall_text(sock)
        journals = set(cache_dir("journal").iterdir())
        proc = subprocess.Popen([sys.executable, "-m", "qprobe.cli", "trace", "--attach", sock, "p:sys __x64_sys_*"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
        try:
            assert proc.stderr is not None
            said = ""
            while "Ctrl-C to stop" not in said:
                said = proc.stderr.readline()
                assert said or proc.poll() is None, "qprobe trace exited before it traced"
            n = int(re.search(r"tracing (\d+) event", said).group(1))  # type: ignore[union-attr]
            proc.send_signal(signal.SIGINT)
            # A bound on waiting, not on speed (qprobe bench times it): one SIGINT must be enough.
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert n >= 400, said
        assert proc.returncode == 130, stderr
        rows = [line for line in stdout.splitlines() if line.startswith("# ")]
        assert len(rows) == n and len({r.split(":")[0] for r in rows}) == n, stdout[-2000:]
        assert all(re.fullmatch(r"# \S+: hits=\d+ nmissed=\d+ lost=\d+", r) for r in rows), rows[:5]
        assert "Traceback" not in stderr and "error" not in stderr, stderr
        assert set(cache_dir("journal").iterdir()) <= journals  # every patch undone: no journal left for the VM
        after, recovered = _syscall_text(sock)
        assert recovered == 0 and after == before
    finally:
        os.kill(owner, signal.SIGTERM)
    _assert_gone_after_sigterm(sock)
