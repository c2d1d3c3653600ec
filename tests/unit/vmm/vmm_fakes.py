"""Fakes for the target tests: RSP framing, a scripted QEMU 7.2 gdbstub, physical RAM, page tables.

Everything here is written independently of qprobe's own code (its own
framing, its own page-table layout), so a test compares two implementations
rather than qprobe with itself.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# -- RSP framing -------------------------------------------------------------------


def csum(body: bytes) -> bytes:
    return b"%02x" % (sum(body) % 256)


def esc(payload: bytes) -> bytes:
    out = bytearray()
    for b in payload:
        if b in b"#$}*":
            out += bytes((ord("}"), b ^ 0x20))
        else:
            out.append(b)
    return bytes(out)


def unesc(body: bytes) -> bytes:
    out = bytearray()
    it = iter(body)
    for b in it:
        out.append(next(it) ^ 0x20 if b == ord("}") else b)
    return bytes(out)


def pkt(payload: bytes, raw: bool = False) -> bytes:
    """``$payload#cs``; ``raw`` leaves the body unescaped (for run-length encoded bodies)."""
    body = payload if raw else esc(payload)
    return b"$" + body + b"#" + csum(body)


# -- the i386-64bit target description as QEMU 7.2 serves it ------------------------

# (name, bitsize) in g-packet order, as QEMU's x86_64 gdbstub lays registers out.
X86_64_REGS: list[tuple[str, int]] = (
    [(r, 64) for r in ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp")]
    + [(f"r{i}", 64) for i in range(8, 16)]
    + [("rip", 64), ("eflags", 32)]
    + [(s, 32) for s in ("cs", "ss", "ds", "es", "fs", "gs")]
    + [("fs_base", 64), ("gs_base", 64), ("k_gs_base", 64)]
    + [(c, 64) for c in ("cr0", "cr2", "cr3", "cr4", "cr8", "efer")]
    + [(f"st{i}", 80) for i in range(8)]
    + [(f, 32) for f in ("fctrl", "fstat", "ftag", "fiseg", "fioff", "foseg", "fooff", "fop")]
    + [(f"xmm{i}", 128) for i in range(16)]
    + [("mxcsr", 32)]
)
G_SIZE = sum(bits for _, bits in X86_64_REGS) // 8

TARGET_XML = (
    '<?xml version="1.0"?><!DOCTYPE target SYSTEM "gdb-target.dtd">'
    "<target><architecture>i386:x86-64</architecture>"
    '<xi:include href="i386-64bit.xml"/></target>'
)


def _reg(name: str, bits: int, extra: str = "") -> str:
    kind = {32: "int32", 64: "int64", 80: "i387_ext", 128: "vec128"}[bits]
    return f'  <reg name="{name}" bitsize="{bits}" type="{kind}"{extra}/>\n'


def _i386_64bit_xml() -> str:
    regs = dict(X86_64_REGS)
    out = [
        '<?xml version="1.0"?>\n',
        "<!-- Copyright notice, as in QEMU's file.\n     It spans lines, like the real one. -->\n\n",
        "<!-- x86_64 64bit -->\n\n",
        '<!DOCTYPE target SYSTEM "gdb-target.dtd">\n',
        '<feature name="org.gnu.gdb.i386.core">\n',
        '  <flags id="x64_eflags" size="4">\n\t<field name="CF" start="0" end="0"/>\n  </flags>\n\n',
        "  <!-- General registers -->\n\n",
        _reg("rax", 64, ' regnum="0"'),
    ]
    out += [_reg(n, 64) for n, _ in X86_64_REGS[1:16]]
    out += ["\n", _reg("rip", 64), _reg("eflags", 32), "\n  <!-- Segment registers -->\n\n"]
    out += [_reg(s, 32) for s in ("cs", "ss", "ds", "es", "fs", "gs")]
    # The bases QEMU does not send are commented out, reg tags and all.
    out += [
        "\n  <!-- Segment descriptor caches and TLS base MSRs -->\n\n",
        '  <!--reg name="cs_base" bitsize="64" type="int64"/>\n',
        '  <reg name="ss_base" bitsize="64" type="int64"/>\n',
        '  <reg name="ds_base" bitsize="64" type="int64"/>\n',
        '  <reg name="es_base" bitsize="64" type="int64"/-->\n',
    ]
    out += [_reg(n, 64) for n in ("fs_base", "gs_base", "k_gs_base")]
    out += [
        "\n  <!-- Control registers -->\n\n",
        '  <flags id="x64_cr3" size="8">\n\t<field name="PDBR" start="12" end="63"/>\n',
        '\t<!--field name="" start="3" end="11"/>\n\t<field name="WT" start="2" end="2"/-->\n',
        '\t<field name="PCID" start="0" end="11"/>\n  </flags>\n\n',
    ]
    out += [_reg(c, 64) for c in ("cr0", "cr2", "cr3", "cr4", "cr8", "efer")]
    out += ["\n  <!-- x87 FPU -->\n\n"] + [_reg(f"st{i}", 80) for i in range(8)]
    out += [_reg(f, 32, ' group="float"') for f, b in X86_64_REGS if b == 32 and f.startswith("f") and f != "fs"]
    out += ['\n  <vector id="v4f" type="ieee_single" count="4"/>\n']
    out += [_reg(f"xmm{i}", 128) for i in range(16)]
    out += [_reg("mxcsr", 32, ' group="vector"'), "\n  <!-- TODO: Add drx, and a few more -->\n</feature>\n"]
    text = "".join(out)
    assert all(f'name="{n}"' in text for n in regs)
    return text


I386_64BIT_XML = _i386_64bit_xml()
# Where QEMU's reply ends the first chunk in the two-chunk tests: inside the
# commented-out block, so comments must be removed after the chunks are joined.
XML_SPLIT = I386_64BIT_XML.index('ss_base"') + 3


def g_offsets() -> dict[str, int]:
    off, out = 0, {}
    for name, bits in X86_64_REGS:
        out[name] = off
        off += bits // 8
    return out


# -- a scripted QEMU 7.2 gdbstub -----------------------------------------------------

CLOSE = object()  # an answer that makes the stub close the connection
SILENT = None  # an answer that sends nothing at all


@dataclass
class Vcpu:
    regs: bytearray = field(default_factory=lambda: bytearray(G_SIZE))
    # Registers numbered past the g packet's (a description's feature that QEMU does not put in g): ``p`` only.
    outside_g: dict[int, bytes] = field(default_factory=dict)

    def set(self, name: str, value: int) -> None:
        off = g_offsets()[name]
        size = dict(X86_64_REGS)[name] // 8
        self.regs[off : off + size] = value.to_bytes(size, "little")


def parse_tid(text: str) -> int:
    """vCPU index (0-based) from ``p1.2``/``p01.02``/``2``."""
    t = text.split(".")[-1] if text.startswith("p") else text
    return int(t, 16) - 1


class QemuStub:
    """The far end of a socketpair, answering like QEMU 7.2's gdbstub, in a thread.

    QEMU semantics that matter here: every packet is acknowledged with ``+``;
    connecting stops the VM and reports ``T02thread:01;`` unsolicited; each
    stop makes the stopped vCPU the ``Hg`` one again (gdb_set_stop_cpu); ``m``
    with more than 2048 bytes is ``E22``; unknown packets get an empty reply.
    ``overrides`` maps a payload prefix to a reply (bytes, SILENT or CLOSE),
    or to a callable taking the payload.
    """

    MAX_PACKET_LENGTH = 4096

    def __init__(self, nvcpus: int = 2, packet_size: int = 0x1000, *, unsolicited_stop: bool = True,
                 xfer_max: int = 2045, xfer_splits: dict[str, list[int]] | None = None,
                 supported: bytes | None = None, sock: socket.socket | None = None,
                 annexes: dict[str, bytes] | None = None) -> None:  # fmt: skip
        # On a socketpair (``client`` is qprobe's end), or on an accepted connection ``sock``.
        self.client: socket.socket | None
        if sock is None:
            self.client, self._sock = socket.socketpair()
        else:
            self.client, self._sock = None, sock
        self.vcpus = [Vcpu() for _ in range(nvcpus)]
        for i, v in enumerate(self.vcpus):
            v.set("rip", 0xFFFF_FFFF_8100_0000 + 0x1000 * i)
            v.set("cr3", 0x0123_4000)
        self.packet_size = packet_size
        self.unsolicited_stop = unsolicited_stop
        self.supported = supported or (
            b"PacketSize=%x;qXfer:features:read+;ReverseStep+;ReverseContinue+;multiprocess+" % packet_size
        )
        # Set before the serving thread starts: a client may ask for them at once.
        self.annexes = {"target.xml": TARGET_XML.encode(), "i386-64bit.xml": I386_64BIT_XML.encode(),
                        **(annexes or {})}  # fmt: skip
        self.xfer_max = xfer_max
        self.xfer_splits = xfer_splits or {}
        self.memory: dict[int, int] = {}  # byte address -> value (whatever m/M address space is in use)
        self.overrides: dict[bytes, object] = {}
        self.g_cpu = 0
        self.c_cpu = 0
        self.running = False
        self.phys_mode = False
        self.requests: list[bytes] = []
        self.frames: list[bytes] = []  # every framed packet received, as sent
        self.interrupts = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="fake-gdbstub", daemon=True)
        self._thread.start()

    # -- test helpers ----------------------------------------------------------
    def fill(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.memory[addr + i] = b

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.memory.get(addr + i, 0) for i in range(size))

    def sent(self, prefix: bytes) -> list[bytes]:
        with self._lock:
            return [r for r in self.requests if r.startswith(prefix)]

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        for s in (self._sock, self.client):
            try:
                if s is not None:
                    s.close()
            except OSError:
                pass
        self._thread.join(2.0)

    # -- the server --------------------------------------------------------------
    def _serve(self) -> None:
        buf = b""
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    return
                buf += data
                while buf:
                    if buf[:1] in (b"+", b"-"):
                        buf = buf[1:]
                        continue
                    if buf[:1] == b"\x03":
                        buf = buf[1:]
                        self.interrupts += 1
                        out = self._interrupt()
                    elif buf[:1] == b"$":
                        end = buf.find(b"#")
                        if end < 0 or len(buf) < end + 3:
                            break
                        frame, body, cs = buf[: end + 3], buf[1:end], buf[end + 1 : end + 3]
                        buf = buf[end + 3 :]
                        if cs != csum(body):
                            self.errors.append(f"bad checksum in {frame!r}")
                        payload = unesc(body)
                        with self._lock:
                            self.requests.append(payload)
                            self.frames.append(frame)
                        if len(frame) > self.MAX_PACKET_LENGTH:
                            self.errors.append(f"command buffer overrun ({len(frame)} bytes)")
                            continue  # QEMU drops it without a reply
                        ans = self._answer(payload)
                        out = ans if ans is CLOSE else b"+" + ans  # type: ignore[operator]
                    else:
                        self.errors.append(f"stray byte {buf[:1]!r}")
                        buf = buf[1:]
                        continue
                    if out is CLOSE:
                        self._sock.close()
                        return
                    if out:
                        self._sock.sendall(out)  # type: ignore[arg-type]
        except OSError:
            return

    def _interrupt(self) -> bytes:
        if not self.running:
            return b""
        self.running = False
        self.g_cpu = self.c_cpu  # gdb_set_stop_cpu
        return pkt(b"T02thread:p01.%02x;" % (self.c_cpu + 1))

    def _answer(self, p: bytes) -> bytes | object:
        for prefix, reply in self.overrides.items():
            if p.startswith(prefix):
                r = reply(p) if callable(reply) else reply
                if r is CLOSE:
                    return CLOSE
                if r is SILENT:
                    return b""
                assert isinstance(r, bytes)
                return pkt(r)
        if p.startswith(b"qSupported"):
            stop = pkt(b"T02thread:01;") if self.unsolicited_stop else b""
            return stop + pkt(self.supported)
        if p.startswith(b"qXfer:features:read:"):
            return pkt(self._xfer(p))
        if p == b"?":
            return pkt(b"T05thread:p01.%02x;" % (self.c_cpu + 1))
        if p == b"qfThreadInfo":
            return pkt(b"m" + b",".join(b"p01.%02x" % (i + 1) for i in range(len(self.vcpus))))
        if p == b"qsThreadInfo":
            return pkt(b"l")
        if p.startswith(b"Hg"):
            i = parse_tid(p[2:].decode())
            if not 0 <= i < len(self.vcpus):
                return pkt(b"E22")
            self.g_cpu = i
            return pkt(b"OK")
        if p == b"g":
            return pkt(self.vcpus[self.g_cpu].regs.hex().encode())
        if p.startswith(b"p"):
            n = int(p[1:], 16)
            if n < len(X86_64_REGS):
                off, size = g_offsets()[X86_64_REGS[n][0]], X86_64_REGS[n][1] // 8
                return pkt(self.vcpus[self.g_cpu].regs[off : off + size].hex().encode())
            data = self.vcpus[self.g_cpu].outside_g.get(n)
            return pkt(b"E14" if data is None else data.hex().encode())
        if p.startswith(b"P"):
            m = re.fullmatch(rb"P([0-9a-f]+)=([0-9a-f]+)", p)
            assert m, p
            n = int(m.group(1), 16)
            name, bits = X86_64_REGS[n]
            data = bytes.fromhex(m.group(2).decode())
            if len(data) != bits // 8:
                return pkt(b"E22")
            off = g_offsets()[name]
            self.vcpus[self.g_cpu].regs[off : off + len(data)] = data
            return pkt(b"OK")
        if p.startswith(b"G"):
            # QEMU 7.2's handle_write_all_regs: registers from number 0 on, while the data lasts.
            data = bytes.fromhex(p[1:].decode())
            self.vcpus[self.g_cpu].regs[: len(data)] = data
            return pkt(b"OK")
        if p.startswith(b"Qqemu.PhyMemMode:"):
            self.phys_mode = p.endswith(b"1")
            return pkt(b"OK")
        if p.startswith(b"m"):
            addr, length = (int(x, 16) for x in p[1:].split(b","))
            if length > self.MAX_PACKET_LENGTH // 2:
                return pkt(b"E22")
            if any(addr + i not in self.memory for i in range(length)):
                return pkt(b"E14")
            return pkt(self.read(addr, length).hex().encode())
        if p.startswith(b"M"):
            head, _, data = p[1:].partition(b":")
            addr, length = (int(x, 16) for x in head.split(b","))
            raw = bytes.fromhex(data.decode())
            if len(raw) != length:
                return pkt(b"E22")
            if any(addr + i not in self.memory for i in range(length)):
                return pkt(b"E14")
            self.fill(addr, raw)
            return pkt(b"OK")
        if p.startswith((b"Z0,", b"z0,")):
            return pkt(b"OK")
        if p == b"vCont;c":
            self.running = True
            return b""
        if p.startswith(b"vCont;s:"):
            i = parse_tid(p[8:].decode())
            self.c_cpu = self.g_cpu = i
            self.vcpus[i].set("rip", int.from_bytes(self.vcpus[i].regs[128:136], "little") + 1)
            return pkt(b"T05thread:p01.%02x;" % (i + 1))
        if p == b"D":
            return pkt(b"OK")
        return pkt(b"")  # not supported

    def _xfer(self, p: bytes) -> bytes:
        m = re.fullmatch(rb"qXfer:features:read:([^:]+):([0-9a-f]+),([0-9a-f]+)", p)
        assert m, p
        annex = m.group(1).decode()
        if annex not in self.annexes:
            return b"E00"
        data = self.annexes[annex]
        off, length = int(m.group(2), 16), min(int(m.group(3), 16), self.xfer_max)
        for split in self.xfer_splits.get(annex, []):
            if off < split < off + length:
                length = split - off
                break
        chunk = data[off : off + length]
        return (b"l" if off + len(chunk) >= len(data) else b"m") + chunk


def wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# -- physical RAM and page tables ----------------------------------------------------

PAGE = 4096
P, RW, US, ACCESSED, DIRTY, PS, GLOBAL = 0x1, 0x2, 0x4, 0x20, 0x40, 0x80, 0x100
PAT_LARGE = 1 << 12  # the PAT bit of a 2 MiB/1 GiB entry, inside the address field
NX = 1 << 63
PKEY = 0xF << 59
FRAME = (1 << 52) - PAGE  # bits 12..51


class PhysRam:
    """Sparse guest-physical memory in 4 KiB frames; reading an absent frame is a test failure."""

    def __init__(self) -> None:
        self.frames: dict[int, bytearray] = {}
        self.reads: list[tuple[int, int]] = []

    def back(self, paddr: int, size: int = PAGE) -> None:
        for pfn in range(paddr // PAGE, (paddr + size - 1) // PAGE + 1):
            self.frames.setdefault(pfn, bytearray(PAGE))

    def write(self, paddr: int, data: bytes) -> None:
        self.back(paddr, max(len(data), 1))
        for i, b in enumerate(data):
            a = paddr + i
            self.frames[a // PAGE][a % PAGE] = b

    def write_u64(self, paddr: int, value: int) -> None:
        self.write(paddr, value.to_bytes(8, "little"))

    def read_phys(self, paddr: int, size: int) -> bytes:
        self.reads.append((paddr, size))
        out = bytearray()
        for a in range(paddr, paddr + size):
            frame = self.frames.get(a // PAGE)
            if frame is None:
                raise AssertionError(f"read of unbacked guest-physical address {a:#x}")
            out.append(frame[a % PAGE])
        return bytes(out)


class PhysRamU64(PhysRam):
    """A reader that also offers the fast ``read_u64_phys`` (as SharedRam does)."""

    def __init__(self) -> None:
        super().__init__()
        self.u64_reads = 0

    def read_u64_phys(self, paddr: int) -> int:
        self.u64_reads += 1
        return int.from_bytes(self.read_phys(paddr, 8), "little")


_LEAF_SHIFT = {PAGE: 12, 2 << 20: 21, 1 << 30: 30}


class PageTables:
    """Builds x86_64 4- or 5-level page tables in a PhysRam."""

    def __init__(self, ram: PhysRam, levels: int = 4, table_base: int = 0x0010_0000) -> None:
        self.ram = ram
        self.levels = levels
        self._next = table_base
        self.root = self.new_table()

    def new_table(self) -> int:
        addr = self._next
        self._next += PAGE
        self.ram.write(addr, bytes(PAGE))
        return addr

    def shifts(self) -> list[int]:
        return [48, 39, 30, 21, 12][5 - self.levels :]

    def slot(self, vaddr: int, shift: int, create: bool = True) -> int:
        """Physical address of the entry for ``vaddr`` in the table at level ``shift``."""
        table = self.root
        for s in self.shifts():
            idx = (vaddr >> s) & 0x1FF
            if s == shift:
                return table + idx * 8
            entry = int.from_bytes(self.ram.read_phys(table + idx * 8, 8), "little")
            if not entry & P:
                if not create:
                    raise KeyError(hex(vaddr))
                new = self.new_table()
                self.ram.write_u64(table + idx * 8, new | P | RW | ACCESSED)
                entry = new | P
            table = entry & FRAME
        raise AssertionError("no such level")

    def map(self, vaddr: int, paddr: int, size: int = PAGE, flags: int = P | RW | ACCESSED | DIRTY) -> int:
        """Map one page; returns the physical address of its leaf entry."""
        assert vaddr % size == 0 and paddr % size == 0
        shift = _LEAF_SHIFT[size]
        slot = self.slot(vaddr, shift)
        self.ram.write_u64(slot, paddr | flags | (PS if size != PAGE else 0))
        return slot

    def entry(self, vaddr: int, shift: int) -> int:
        return int.from_bytes(self.ram.read_phys(self.slot(vaddr, shift, create=False), 8), "little")

    def set_entry(self, vaddr: int, shift: int, value: int) -> None:
        self.ram.write_u64(self.slot(vaddr, shift), value)
