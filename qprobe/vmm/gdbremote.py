"""The GDB remote protocol as QEMU 7.2's gdbstub speaks it, one method per request.

Registers come from the stub's own target description (``qXfer:features``,
read by qprobe.vmm.tdesc), so offsets in the ``g`` packet are never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

from qprobe.errors import GuestTimeout, ProtocolError, TargetError
from qprobe.vmm.connection import Connection
from qprobe.vmm.rsp import StopReply, hex_to_bytes, normalize_thread, parse_stop_reply
from qprobe.vmm.tdesc import RegDesc, read_target_description

BREAK_SW, BREAK_HW, WATCH_WRITE, WATCH_READ, WATCH_ACCESS = range(5)
# Bounds on what a stub may send, so that a broken or hostile one cannot keep qprobe looping or
# growing forever (the target description's are qprobe.vmm.tdesc's).  QEMU 7.2 sends 1 stop reply
# before the features, one thread-list entry per vCPU, and PacketSize=1000.
MAX_EARLY_STOPS = 16
MAX_THREADS = 4096
# Memory is moved in chunks of (PacketSize - 32) / 2 bytes: below this a chunk would be empty or
# negative and a write would silently write nothing.
MIN_PACKET_SIZE = 0x40
MAX_PACKET_SIZE = 1 << 20
FIRST_REPLY_TIMEOUT = 10.0


class GdbRemote:
    """Requests to one stub.  A single thread must own an instance."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.packet_size = 0x1000
        self.regs: dict[str, RegDesc] = {}
        self.architecture = ""  # as the target description names it (<architecture>), "" if it does not
        # The registers every read_registers must bring (the architecture's RegisterLayout.stop_registers,
        # given once it is known): those the ``g`` packet lacks are read with ``p``.
        self.needed: frozenset[str] = frozenset()
        self._g_prefix: list[RegDesc] = []
        self._hg: str | None = None
        self._phys = False
        self.running = False
        # Each vCPU's registers as last read or written during this stop: they change only through us
        # until the VM runs again.  What a ``G`` needs for the registers it does not change.
        self._known: dict[str, dict[str, int]] = {}

    # -- set-up ------------------------------------------------------------
    def handshake(self) -> StopReply:
        """Negotiate features, learn the registers, return the current stop state."""
        self.conn.send(b"qSupported:multiprocess+;swbreak+;hwbreak+;xmlRegisters=i386")
        try:
            reply = self.conn.recv(FIRST_REPLY_TIMEOUT)
        except GuestTimeout:
            raise GuestTimeout(
                f"the gdbstub at {self.conn.name} did not answer within {FIRST_REPLY_TIMEOUT:g} s: is another "
                "debugger attached to it? QEMU's gdbstub serves one client at a time"
            ) from None
        # Connecting stops a running VM, and QEMU reports that stop unsolicited
        # (``T02thread:01;``), possibly before the answer to our first packet.
        for _ in range(MAX_EARLY_STOPS):
            if reply[:1] not in (b"T", b"S"):
                break
            reply = self.conn.recv()
        else:
            raise ProtocolError(f"the gdbstub sent more than {MAX_EARLY_STOPS} stop replies instead of its features")
        for feature in reply.split(b";"):
            if feature.startswith(b"PacketSize="):
                self.packet_size = _packet_size(feature.split(b"=", 1)[1])
        if b"qXfer:features:read+" not in reply:
            raise ProtocolError("the gdbstub offers no target description (qXfer:features:read)")
        desc = read_target_description(self.conn.request)
        self.regs, self.architecture = desc.regs, desc.architecture
        # Connecting stops the VM; '?' tells us where (a \x03 now would get no reply).
        stop = parse_stop_reply(self.conn.request(b"?"))
        self.running = False
        self._hg = None
        # QEMU keeps its physical-memory mode across clients (one flag of the stub's): a qprobe killed while
        # in it would leave this one reading virtual addresses as physical.  A stub without it has no mode.
        self.conn.request(b"Qqemu.PhyMemMode:0")
        self._phys = False
        return stop

    def allow_g(self, plain: Collection[str]) -> None:
        """Let a ``G`` carry the registers numbered 0, 1, ... in packet order while they are in ``plain``.

        ``plain`` are the architecture's registers whose write has no effect beyond
        the value (see write_registers); until this is called every write is a ``P``.
        """
        by_num = sorted(self.regs.values(), key=lambda d: d.regnum)
        self._g_prefix = []
        for i, d in enumerate(by_num):
            if d.regnum != i or d.name not in plain or d.offset != sum(x.size for x in by_num[:i]):
                break
            self._g_prefix.append(d)

    # -- replies -----------------------------------------------------------
    def _ok(self, reply: bytes, what: str) -> None:
        if reply != b"OK":
            raise TargetError(f"gdbstub refused {what}: {_describe(reply)}")

    def request(self, payload: bytes) -> bytes:
        if self.running:
            raise TargetError(f"internal: request {payload[:20]!r} sent while the VM runs")
        return self.conn.request(payload)

    # -- threads = vCPUs ---------------------------------------------------
    def threads(self) -> list[str]:
        out: list[str] = []
        reply = self.request(b"qfThreadInfo")
        while reply.startswith(b"m"):
            try:
                out += [normalize_thread(t) for t in reply[1:].decode().split(",") if t]
            except ValueError:
                raise ProtocolError(f"bad thread list entry in {_describe(reply)}") from None
            if len(out) > MAX_THREADS:
                raise ProtocolError(f"the gdbstub lists more than {MAX_THREADS} threads")
            reply = self.request(b"qsThreadInfo")
        if reply != b"l":
            raise ProtocolError(f"bad thread list reply {_describe(reply)}")
        if not out:
            raise ProtocolError("the gdbstub lists no threads (vCPUs)")
        return out

    def select(self, tid: str) -> None:
        if self._hg != tid:
            self._ok(self.request(b"Hg" + tid.encode()), f"selecting vCPU {tid}")
            self._hg = tid

    # -- registers -----------------------------------------------------------
    def read_registers(self, tid: str) -> dict[str, int]:
        """Every register up to 64 bits wide that ``g`` brings, and each of ``needed`` it does not, by ``p``.

        QEMU sends in ``g`` only what fits, and only the registers of the
        features it puts there: aarch64's system registers (TTBR1_EL1,
        TPIDR_EL1, SP_EL0) are described in a feature of their own and read
        one by one.
        """
        self.select(tid)
        raw = hex_to_bytes(self.request(b"g"))
        out = {}
        for d in self.regs.values():
            if d.offset + d.size <= len(raw) and d.bitsize <= 64:
                out[d.name] = int.from_bytes(raw[d.offset : d.offset + d.size], "little")
        for name in sorted(self.needed.difference(out)):
            desc = self.regs.get(name)
            value = None if desc is None else _register_value(self.request(b"p%x" % desc.regnum), desc)
            if value is not None:
                out[name] = value
        missing = self.needed.difference(out)
        if missing:
            raise ProtocolError(f"the gdbstub sent no {', '.join(sorted(missing))} for vCPU {tid} "
                                f"(a {len(raw)}-byte register packet, and p refused)")  # fmt: skip
        self._known[tid] = dict(out)
        return out

    def write_register(self, tid: str, name: str, value: int) -> None:
        d = self.regs[name]
        self.select(tid)
        data = (value & ((1 << d.bitsize) - 1)).to_bytes(d.size, "little").hex()
        self._ok(self.request(b"P%x=%s" % (d.regnum, data.encode())), f"writing register {name}")
        if tid in self._known:
            self._known[tid][name] = value & ((1 << d.bitsize) - 1)

    def write_registers(self, tid: str, values: dict[str, int]) -> None:
        """Write several registers: one ``G`` where it can, else one ``P`` each.

        QEMU 7.2's ``G`` (handle_write_all_regs) writes registers from number 0
        on for as long as the packet's data lasts, so a prefix that ends at the
        highest register written replaces them in one round trip; the others in
        the prefix get their current value back.  Only the registers ``allow_g``
        was given are ever in that prefix: writing a control register even with
        its own value has effects (a TLB flush on x86's CR0/CR3/CR4).

        Two registers are already one ``G``: the stub applies a packet whole, so
        a qprobe killed part way through an instruction's writes (a result and
        the ip past it) cannot leave the vCPU with one and not the other, which
        would run the instruction twice or skip its result.
        """
        descs = [self.regs[name] for name in values]
        top = max((d.regnum for d in descs), default=-1)
        prefix = self._g_prefix[: top + 1]
        if len(values) < 2 or len(prefix) != top + 1:
            for name, value in values.items():
                self.write_register(tid, name, value)
            return
        known = self._known.get(tid) or self.read_registers(tid)
        merged = {d.name: values.get(d.name, known[d.name]) & ((1 << d.bitsize) - 1) for d in prefix}
        data = b"".join(merged[d.name].to_bytes(d.size, "little") for d in prefix)
        self.select(tid)
        self._ok(self.request(b"G" + data.hex().encode()), f"writing registers {', '.join(values)}")
        self._known.setdefault(tid, dict(known)).update(merged)

    # -- memory --------------------------------------------------------------
    @property
    def chunk(self) -> int:
        # Hex doubles the size; leave room for the framing and command.
        return (self.packet_size - 32) // 2

    def set_physical(self, on: bool) -> None:
        """``Qqemu.PhyMemMode``: m/M take guest-physical addresses."""
        if self._phys != on:
            self._ok(self.request(b"Qqemu.PhyMemMode:%d" % on), "physical memory mode")
            self._phys = on

    def read_memory(self, addr: int, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            n = min(self.chunk, size - len(out))
            reply = self.request(b"m%x,%x" % (addr + len(out), n))
            if not reply or (reply.startswith(b"E") and len(reply) == 3):
                raise TargetError(f"cannot read guest memory at {addr + len(out):#x}: {_describe(reply)}")
            data = hex_to_bytes(reply)
            if not 0 < len(data) <= n:  # fewer is allowed (the rest is asked for again), more or none is not
                raise ProtocolError(f"the gdbstub answered a {n}-byte read with {len(data)} bytes")
            out += data
        return bytes(out)

    def write_memory(self, addr: int, data: bytes) -> None:
        for off in range(0, len(data), self.chunk):
            part = data[off : off + self.chunk]
            reply = self.request(b"M%x,%x:%s" % (addr + off, len(part), part.hex().encode()))
            self._ok(reply, f"writing guest memory at {addr + off:#x}")

    # -- breakpoints -----------------------------------------------------------
    def insert_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        self._ok(self.request(b"Z%d,%x,%x" % (kind, addr, length)), f"breakpoint at {addr:#x}")

    def remove_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        self._ok(self.request(b"z%d,%x,%x" % (kind, addr, length)), f"removing breakpoint at {addr:#x}")

    # -- execution -------------------------------------------------------------
    def cont(self) -> None:
        self.conn.send(b"vCont;c")
        self._running()

    def _running(self) -> None:
        # Every stop makes QEMU select the stopped vCPU for Hg again (gdb_set_stop_cpu):
        # our idea of the selected vCPU does not survive the VM running, nor do its registers.
        self.running = True
        self._hg = None
        self._known.clear()

    def step(self, tid: str, timeout: float = 10.0) -> StopReply:
        """Single-step one vCPU; the others stay stopped (QEMU's gdb_continue_partial)."""
        self.conn.send(b"vCont;s:" + tid.encode())
        self._running()
        return self.wait_stop(timeout)

    def interrupt(self) -> None:
        # While the VM runs, any byte stops it; \x03 is the conventional one.
        self.conn.send_raw(b"\x03")

    def wait_stop(self, timeout: float | None = 10.0) -> StopReply:
        stop = parse_stop_reply(self.conn.recv(timeout))
        self.running = False
        self._hg = None
        return stop

    def poll_stop(self, timeout: float, wake: int | None = None) -> StopReply | None:
        payload = self.conn.poll(timeout, wake)
        if payload is None:
            return None
        self.running = False
        self._hg = None
        return parse_stop_reply(payload)

    def close(self) -> None:
        self.conn.close()

    def detach(self) -> None:
        """``D``: the VM runs on without us."""
        try:
            # With multiprocess+ QEMU 7.2 answers a bare D with E22 and leaves the VM paused.
            self.conn.send(b"D;1")
            self.conn.recv(2.0)
        finally:
            self.conn.close()


def drop_stale_breakpoints(request: Callable[[bytes], bytes], vcpus: Sequence[str]) -> None:
    """Take out, on every vCPU, the breakpoints and watchpoints an earlier client of the stub left.

    QEMU keeps a client's ``Z`` breakpoints after the client is gone (a SIGKILLed qprobe): whoever runs
    their address next stops the VM with nobody to serve it, and later stops there again at every resume.
    Its cleanup is the ``?`` a debugger sends when it connects, which since QEMU 7.1 (the accelerator's
    ``remove_all_breakpoints``: tcg_remove_all_breakpoints) empties the lists of one vCPU, the one selected
    for ``c``: vCPU 0 after a connect.  The others keep theirs, and a ``z`` cannot reach them either: QEMU
    removes a breakpoint vCPU by vCPU and gives up, with E22, at the first one without it, vCPU 0.  So each
    other vCPU is selected with ``Hc`` and asked ``?``; then vCPU 0 is selected again, as a connect left it.
    A new client owns no breakpoint yet, so everything there is an earlier one's.
    """
    for tid in vcpus[1:]:
        reply = request(b"Hc" + tid.encode())
        if reply != b"OK":
            raise TargetError(f"gdbstub refused selecting vCPU {tid} for Hc: {_describe(reply)}")
        parse_stop_reply(request(b"?"))
    if len(vcpus) > 1:
        request(b"Hc" + vcpus[0].encode())


def _register_value(reply: bytes, d: RegDesc) -> int | None:
    """A ``p`` reply's value of register ``d``; None for an error, an empty (unsupported) reply or one not
    of its size (``x`` digits: unavailable)."""
    if len(reply) != 2 * d.size or not re.fullmatch(rb"[0-9a-fA-F]+", reply):
        return None
    return int.from_bytes(bytes.fromhex(reply.decode()), "little")


def _packet_size(text: bytes) -> int:
    try:
        size = int(text, 16)
    except ValueError:
        raise ProtocolError(f"the gdbstub's PacketSize {text[:20]!r} is not a hex number") from None
    if size < MIN_PACKET_SIZE:
        raise ProtocolError(f"the gdbstub's PacketSize {size:#x} is too small to carry qprobe's requests "
                            f"(at least {MIN_PACKET_SIZE:#x})")  # fmt: skip
    return min(size, MAX_PACKET_SIZE)


def _describe(reply: bytes) -> str:
    if not reply:
        return "empty reply (not supported)"
    if reply.startswith(b"E"):
        return f"error {reply.decode(errors='replace')}"
    return repr(reply[:40])
