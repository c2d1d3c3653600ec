"""glibc's indirect functions (STT_GNU_IFUNC) by name: ``strlen`` at its resolver, ``strlen@impl`` at the
implementation the guest's loader picked, each hit as often as the guest kernel's own uprobe_events on the
same offset of the same file is hit by the same command.

The guest's libc is the host's, copied into the guest tree with the dynamic /bin/uprog; the resolver's offset
comes from LIEF on that copy (the symbol's value), the implementation's from the guest's memory, as qprobe
reads it.  ``uprog call 3 1 2 hi`` runs the resolver while its loader relocates libc and uprog, and the
implementation for each strlen of printf's ``%s`` and of the program's own.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator

import lief
import pytest

import qprobe
from qprobe import Uprobe
from qprobe.images.guest import guest_tree
from qprobe.kernel.usyntax import render_user_funcs

from .guest_oracle import TRACING
from .one_tcg_thread import qprobe_boot_kwargs

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("UPROBE_EVENTS")]
__all__ = ["qprobe_boot_kwargs"]  # a fixture: the guest enables its own events

COMMAND = "uprog call 3 1 2 hi"
HOLDER = "/tmp/ifunc-holder.out"  # a uprog that sleeps with libc mapped, so strlen@impl can be read


@pytest.fixture(scope="module")
def libc() -> tuple[str, lief.ELF.Binary]:
    """The guest's libc.so.6 (its path in the guest) and its ELF, from the host's copy of the guest tree."""
    tree = guest_tree()
    found = sorted(p for p in tree.rglob("libc.so.6") if p.is_file() and not p.is_symlink())
    assert found, f"no libc.so.6 in {tree}"
    elf = lief.ELF.parse(str(found[0]))
    assert isinstance(elf, lief.ELF.Binary)
    return "/" + found[0].relative_to(tree).as_posix(), elf


@pytest.fixture
def cached(target: qprobe.Target, qprobe_reset: object, libc: tuple[str, lief.ELF.Binary]) -> Iterator[str]:
    """The guest's libc, in its page cache (qprobe reads its symbols there)."""
    target.run(f"cat {libc[0]} >/dev/null").check()
    yield libc[0]


def _resolver_offset(elf: lief.ELF.Binary) -> int:
    (sym,) = [s for s in elf.dynamic_symbols if s.name == "strlen" and s.type == lief.ELF.Symbol.TYPE.GNU_IFUNC]
    offset = elf.virtual_address_to_offset(sym.value)
    assert isinstance(offset, int), offset
    return offset


def _pid(output: str) -> int:
    m = re.search(r"^uprog mode=call .*\bpid=(\d+) .*\bbad=0\b", output, re.M)
    assert m, output
    return int(m[1])


def _qprobe_hits(target: qprobe.Target, path: str, symbol: str) -> tuple[int, int]:
    """(file offset, hits in COMMAND's process) of a uprobe qprobe places on ``path``'s ``symbol``."""
    hits = Counter[int]()

    def handler(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        hits[target.current_task(regs).pid] += 1

    up = Uprobe(path, symbol=symbol, handler=handler)
    target.register_uprobe(up)
    try:
        pid = _pid(target.run(COMMAND).check().output)
    finally:
        target.unregister_uprobe(up)
    assert up.offset is not None
    return up.offset, hits[pid]


def _guest_hits(target: qprobe.Target, path: str, offset: int) -> int:
    """Hits in COMMAND's process of the guest kernel's own uprobe on ``path``'s ``offset``."""
    events = f"{TRACING}/uprobe_events"
    target.run(f"echo > {TRACING}/trace && echo 'p:qifunc {path}:{offset:#x}' > {events} "
               f"&& echo 1 > {TRACING}/events/uprobes/qifunc/enable").check()  # fmt: skip
    try:
        pid = _pid(target.run(COMMAND).check().output)
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
        trace = target.run(f"cat {TRACING}/trace").check().output  # before the removal: it clears the buffer
    finally:
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable; echo > {events}")
    return len(re.findall(rf"^\s*\S+-{pid}\s+\[\d+\] .*: qifunc: \(", trace, re.M))


def test_funcs_x_lists_strlen_as_an_indirect_function(
    target: qprobe.Target, cached: str, libc: tuple[str, lief.ELF.Binary]
) -> None:
    text, summary, _ = render_user_funcs(target.user_elf(cached), cached, ["strlen", "getppid"])
    sizes = {s.name: s.size for s in libc[1].dynamic_symbols}
    assert f"0x{_resolver_offset(libc[1]):08x} {sizes['strlen']:8d} strlen [ifunc]" in text.splitlines(), text
    assert "[ifunc]" not in next(ln for ln in text.splitlines() if ln.endswith(" getppid")), text
    assert "NAME@impl" in summary


def test_strlen_is_its_resolver_hit_as_the_guest_kernel_hits_it(
    target: qprobe.Target, cached: str, libc: tuple[str, lief.ELF.Binary]
) -> None:
    offset, hits = _qprobe_hits(target, cached, "strlen")
    assert offset == _resolver_offset(libc[1])
    assert hits == _guest_hits(target, cached, offset) and hits > 0


def test_strlen_at_impl_is_the_loaders_pick_hit_as_the_guest_kernel_hits_it(
    target: qprobe.Target, cached: str, libc: tuple[str, lief.ELF.Binary]
) -> None:
    target.run(f"rm -f {HOLDER}; (uprog wait-then-call 600 1 > {HOLDER} 2>&1 &)").check()
    deadline = time.monotonic() + 120
    while not re.search(r"^uprog pid=(\d+)", target.run(f"cat {HOLDER} 2>/dev/null").output, re.M):
        assert time.monotonic() < deadline, "the holder never started"
        target.wait(0.2)
    holder = re.search(r"^uprog pid=(\d+)", target.run(f"cat {HOLDER}").output, re.M)
    assert holder is not None
    try:
        offset, hits = _qprobe_hits(target, cached, "strlen@impl")
    finally:
        target.run(f"kill {holder[1]}")
    text = [s for s in libc[1].segments if s.type == lief.ELF.Segment.TYPE.LOAD and s.has(lief.ELF.Segment.FLAGS.X)]
    assert any(s.file_offset <= offset < s.file_offset + s.physical_size for s in text), hex(offset)
    assert offset != _resolver_offset(libc[1])
    assert hits == _guest_hits(target, cached, offset) and hits > 0
