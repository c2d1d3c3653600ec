"""perf probe's language on the real guest: a source line and a local variable, against the guest's own kprobe_events.

The expectations are read from Debian's 6.1.0-56-cloud-amd64 kernel (the same code in 6.1.0-57), not from qprobe:
in fs/read_write.c, vfs_read is declared on line 450 and line 473 (vfs_read:23) is ``if (ret > 0)``, after
the read returned.  Its one is_stmt row in the line table is vfs_read+0xa8 (``test %rbx,%rbx`` right after
``mov %rax,%rbx`` took the read's result, objdump -d), ``file`` was copied to %rbp before the call, and
``offsetof(struct file, f_pos)`` is 0x68 (gdb: ``print &((struct file *)0)->f_pos``); ``ret`` is ssize_t
and f_pos loff_t, both signed 64-bit.  So ``perf probe -n -v 'vfs_read:23 ret file->f_pos'`` writes the
arguments ``ret=%bx:s64 f_pos=+104(%bp):s64`` at vfs_read+168.  ksys_read passes vfs_read a copy of f_pos
and stores it back only after vfs_read returns, so at line 473 file->f_pos is the offset the read began at.
The tests run on a kernel whose DWARF, as binutils' addr2line reads it, puts vfs_read+0xa8 at that line:
the kernel these expectations are true of (the guest's own kprobe_events then confirms the registers).
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import qprobe
from qprobe.shell import Shell

from .conftest import IMAGE, _elf_function, workload_result
from .conftest import shell_do as do
from .guest_oracle import TRACING

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("KPROBE_EVENTS")]
ROOT = Path(__file__).resolve().parents[2]
SITE, SITE_LINE = 0xA8, "fs/read_write.c:473"  # vfs_read+0xa8, `if (ret > 0)`: vfs_read:23
ARGS = "ret=%bx:s64 f_pos=+104(%bp):s64"
LINE = re.compile(r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[\d+\]\s+\S+\s+[\d.]+: (?P<event>\w+): (?P<body>.*)$")
READS, SIZE = 4, 100
WORKLOAD = f"rm -f /tmp/pp; workload read {READS} {SIZE} /tmp/pp"


@pytest.fixture
def shell(target: qprobe.Target, guard: dict[int, bytes]) -> Iterator[tuple[Shell, io.StringIO]]:
    where = _line_of(target.symbols.path, "vfs_read", SITE)
    if not where.endswith(f"/{SITE_LINE}") and where != SITE_LINE:
        pytest.skip(f"vfs_read+{SITE:#x} is {where}, not {SITE_LINE}, in this kernel's DWARF (addr2line): "
                    "a vfs_read other than the one the expectations were read from")  # fmt: skip
    out = io.StringIO()
    try:
        yield Shell(target, out=out), out
    finally:
        for te in list(target.events.values()):
            target.remove_event(te)


def _line_of(vmlinux: Path, func: str, offset: int) -> str:
    """file:line of ``func+offset`` as binutils reads vmlinux (nm for the address, addr2line for the line)."""
    out = subprocess.run(["addr2line", "-e", str(vmlinux), hex(_elf_function(vmlinux, func)[0] + offset)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.split(" (discriminator")[0].strip()


def _guest_bodies(target: qprobe.Target, definition: str) -> list[str]:
    """The guest's own kprobe_events on ``definition`` (alone at its address), hits of one workload run."""
    enable = f"{TRACING}/events/kprobes/gperf/enable"
    target.run(f"echo 'p:gperf {definition}' >> {TRACING}/kprobe_events && echo > {TRACING}/trace && "
               f"echo 1 > {enable}").check()  # fmt: skip
    try:
        pid = int(workload_result(target.run(WORKLOAD).check().output)["pid"])
        target.run(f"echo 0 > {enable}").check()
        trace = target.run(f"cat {TRACING}/trace").check().output.splitlines()
    finally:
        target.run(f"echo 0 > {enable}; echo '-:gperf' >> {TRACING}/kprobe_events")
    return [m["body"] for m in map(LINE.match, trace) if m and m["event"] == "gperf" and int(m["pid"]) == pid]


def _our_bodies(target: qprobe.Target, event: str) -> list[str]:
    pid = int(workload_result(target.run(WORKLOAD).check().output)["pid"])
    te = next(te for te in target.events.values() if te.definition.event == event)
    return [h.body for h in te.hits if h.pid == pid]


def test_a_source_line_and_a_local_give_the_guests_values(target: qprobe.Target,
                                                          shell: tuple[Shell, io.StringIO]) -> None:  # fmt: skip
    sh, out = shell
    guest = _guest_bodies(target, f"vfs_read+168 {ARGS}")
    # From the source: every read returns SIZE and begins where the last one ended.
    values = [re.findall(r"ret=(-?\d+) f_pos=(-?\d+)", body) for body in guest]
    assert values == [[(str(SIZE), str(i * SIZE))] for i in range(READS)], guest

    text = do(sh, out, "perf vfs_read:23 ret file->f_pos")
    assert text.splitlines()[0] == f"writing event: p:probe/vfs_read_L23 vfs_read+168 {ARGS}", text
    assert _our_bodies(target, "vfs_read_L23") == guest
    do(sh, out, "-:probe/vfs_read_L23")

    # SRC:ALN names the same address; the event is named after its function, as perf names it.
    text = do(sh, out, "perf fs/read_write.c:473 ret")
    assert text.splitlines()[0] == "writing event: p:probe/vfs_read vfs_read+168 ret=%bx:s64", text
    assert _our_bodies(target, "vfs_read") == [body.split(" f_pos=")[0] for body in guest]


def test_parameters_at_the_function_entry_give_the_guests_values(target: qprobe.Target,
                                                                 shell: tuple[Shell, io.StringIO]) -> None:  # fmt: skip
    """perf probe's own example, 'vfs_read count file->f_pos': at the entry the parameters are in the
    calling convention's registers (count in %rdx, file in %rdi: their location lists start there), count is
    size_t (unsigned: x64 on a kernel whose README lists x types) and f_pos at offset 0x68."""
    sh, out = shell
    guest = _guest_bodies(target, "vfs_read count=%dx:x64 f_pos=+104(%di):s64")
    values = [re.findall(r"count=(\S+) f_pos=(-?\d+)", body) for body in guest]
    assert values == [[(f"{SIZE:#x}", str(i * SIZE))] for i in range(READS)], guest
    text = do(sh, out, "perf vfs_read count file->f_pos")
    assert text.splitlines()[0] == "writing event: p:probe/vfs_read vfs_read count=%dx:x64 f_pos=+104(%di):s64", text
    assert _our_bodies(target, "vfs_read") == guest


def test_unfetchable_variables_are_one_line_errors(target: qprobe.Target,
                                                      shell: tuple[Shell, io.StringIO]) -> None:  # fmt: skip
    sh, out = shell
    # Line 461 (ret = rw_verify_area(...)) is before ret has a location: its location list starts at +0x72.
    text = do(sh, out, "perf vfs_read:11 ret")
    assert text.startswith("error: vfs_read:11: ret is optimized out here ") and text.count("\n") == 1, text
    # count at line 473 is min(count, MAX_RW_COUNT) computed from its entry value: a DWARF expression.
    text = do(sh, out, "perf vfs_read:23 count")
    assert text.startswith("error: vfs_read:23: count is computed here (DW_OP_entry_value"), text
    assert text.count("\n") == 1
    assert do(sh, out, "perf vfs_read:23 nosuch") == "error: vfs_read:23: no variable nosuch here\n"
    text = do(sh, out, "perf vfs_read:23 file->f_poss")
    assert text == "error: vfs_read:23: file->f_poss: struct file has no member f_poss\n"
    assert not target.events


def test_cli_refuses_an_unknown_variable_or_function_before_booting() -> None:
    out = subprocess.run([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "perf vfs_read nosuch"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and out.stderr == "qprobe: error: vfs_read: no variable nosuch here\n", out.stderr
    out = subprocess.run([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "perf vfs_raed count"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "no symbol 'vfs_raed'" in out.stderr and "did you mean vfs_read" in out.stderr
