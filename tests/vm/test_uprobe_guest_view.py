"""What the guest sees of a probed file: the file (``read()``, after ``sync`` and eviction the disk's bytes)
and the probed process's memory (``/proc/PID/mem``), with qprobe's uprobe armed and with the kernel's own.

qprobe's breakpoints (``in_guest=False``) are the gdbstub's: nothing is written anywhere, so every view
shows the original bytes.  The kernel's uprobe writes an int3 into a private copy of the page in each mm
that maps the file (``uprobe_write_opcode``): ``/proc/PID/mem`` shows its 0xcc while ``read()`` and the
disk keep the file's bytes; a uprobe counted in the guest is the kernel's, and shows the same.  Run on
``debian-cloud-disk`` (root on an ext2 NVMe disk) for the disk; it runs on every image.
"""

from __future__ import annotations

import hashlib
import re

import lief
import pytest

import qprobe
from qprobe import Uprobe
from qprobe.images.guest import guest_tree

from .guest_oracle import TRACING
from .one_tcg_thread import qprobe_boot_kwargs

pytestmark = pytest.mark.vm
__all__ = ["qprobe_boot_kwargs"]  # a fixture: the guest enables its own events

PROG = "/bin/uprog"
EVICT = "sync; echo 3 > /proc/sys/vm/drop_caches"


def original(symbol: str) -> tuple[int, bytes]:
    """The file offset of ``symbol`` in the guest's program and the 16 bytes there, from the host's copy."""
    path = guest_tree() / PROG.lstrip("/")
    elf = lief.parse(str(path))
    assert elf is not None
    offset = int(elf.virtual_address_to_offset(elf.get_symbol(symbol).value))
    return offset, path.read_bytes()[offset : offset + 16]


def views(target: qprobe.Target, offset: int, pid: int, addr: int) -> dict[str, bytes | str]:
    """The file's md5sum and bytes at ``offset`` as read() gives them, then after eviction (the disk's), and
    16 bytes of the process's memory at ``addr`` (/proc/PID/mem)."""

    def hexbytes(command: str) -> bytes:
        return bytes.fromhex(target.run(f"{command} 2>/dev/null | od -An -tx1 -v").check().output.replace("\n", ""))

    file_read = f"dd if={PROG} bs=1 skip={offset} count=16"
    out: dict[str, bytes | str] = {
        "md5": target.run(f"md5sum {PROG}").check().output.split()[0],
        "read": hexbytes(file_read),
        "mem": hexbytes(f"dd if=/proc/{pid}/mem bs=1 skip=$(({addr:#x})) count=16"),
    }
    target.run(EVICT).check()
    out["md5 evicted"] = target.run(f"md5sum {PROG}").check().output.split()[0]
    out["read evicted"] = hexbytes(file_read)
    return out


@pytest.mark.parametrize("in_guest", [False, True], ids=["stub", "guest"])
def test_the_file_and_the_process_memory_keep_the_original_bytes(target: qprobe.Target, qprobe_reset: object,
                                                                 in_guest: bool) -> None:  # fmt: skip
    if in_guest and "uprobe_register" not in target.symbols:
        pytest.skip("the guest kernel has no uprobe_register() (CONFIG_UPROBES)")
    offset, code = original("qpt_target")
    target.run(f"ls {PROG} >/dev/null").check()
    md5 = target.run(f"{EVICT}; md5sum {PROG}").check().output.split()[0]
    assert md5 == hashlib.md5((guest_tree() / PROG.lstrip("/")).read_bytes()).hexdigest()  # the host's copy
    target.run("rm -f /tmp/v.out; (uprog wait-then-call 600 2; echo rc=$?) > /tmp/v.out 2>&1 &").check()
    m = None
    for _ in range(100):
        m = re.search(r"^uprog pid=(\d+) target=(0x[0-9a-f]+)", target.run("cat /tmp/v.out").output, re.M)
        if m:
            break
        target.wait(0.2)
    assert m is not None
    pid, addr = int(m[1]), int(m[2], 16)
    expected = {"md5": md5, "read": code, "mem": code, "md5 evicted": md5, "read evicted": code}

    up = Uprobe(PROG, offset, in_guest=in_guest)
    target.register_uprobe(up)
    try:
        qprobe_view = views(target, offset, pid, addr)
    finally:
        target.unregister_uprobe(up)
    # Counted in the guest, the kernel's int3 in the process's copy (as its own uprobe_events' below).
    assert qprobe_view == ({**expected, "mem": b"\xcc" + code[1:]} if in_guest else expected)
    assert views(target, offset, pid, addr)["mem"] == code  # unregistered: the original byte back
    if target.run(f"test -w {TRACING}/uprobe_events").status != 0:
        target.run(f"kill {pid}")
        return  # no CONFIG_UPROBES: nothing to compare with
    target.run(f"echo 'p:uprobes/gv {PROG}:{offset:#x}' > {TRACING}/uprobe_events; "
               f"echo 1 > {TRACING}/events/uprobes/gv/enable").check()  # fmt: skip
    try:
        kernel_view = views(target, offset, pid, addr)
    finally:
        target.run(f"echo 0 > {TRACING}/events/uprobes/gv/enable; echo > {TRACING}/uprobe_events").check()
    # The kernel's int3 in the process's private copy of the page; the file and the disk keep theirs.
    assert kernel_view == {**expected, "mem": b"\xcc" + code[1:]}
    # Removed, the kernel puts the original byte back in the process's copy.
    assert views(target, offset, pid, addr)["mem"] == code
    target.run(f"kill {pid}; sleep 0.2")
    # Nothing maps it now: evicted, every byte is read again from the disk (or the initramfs).
    assert target.run(f"{EVICT}; md5sum {PROG}").check().output.split()[0] == md5
