"""The gdb transport (qprobe.vmm.transport.GdbTransport) carried by a real gdb driven through GDB/MI.

Why a second transport: a real gdb sitting between qprobe and QEMU proves
that qprobe's use of the stub is something gdb itself can do (interoperability),
and it gives the shell's raw ``gdb CMD`` a full gdb to talk to, symbols and all.
``GdbMiRemote`` implements ``GdbTransport`` as ``GdbRemote`` does; the stop
loop, kprobes and kretprobes cannot tell them apart.

Three modules, as pygdbmi keeps its parser, its IO manager and its controller
apart: qprobe.vmm.gdbmi_parse turns MI records into qprobe's types,
qprobe.vmm.gdbmi_channel is the I/O with one gdb process, and this module is
the transport on top, one method per ``GdbTransport`` method.

gdb settings that matter, and why:

* ``mi-async on``: ``-exec-interrupt`` only works while the target runs in the background;
* ``scheduler-locking step`` (set after connecting, gdb refuses it before):
  ``stepi`` resumes only the stepped vCPU (``vCont;s:TID``), ``continue`` resumes all;
* ``breakpoint always-inserted on``: gdb would otherwise remove every breakpoint
  at each stop and insert it again at each resume, two packets per stop;
* ``stack-cache``/``code-cache off``: we switch QEMU's physical-memory mode behind
  gdb's back, so gdb must not serve a read from a cache filled in the other mode;
* ``osabi none``: the guest is a kernel, not a Linux process.

gdb 8.3 and later connect to a Unix socket given as a plain path to ``target remote``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.gdbmi_channel import MiChannel
from qprobe.vmm.gdbmi_parse import (
    gdb_address,
    mi_quote,
    one_line,
    parse_architecture,
    parse_breakpoint_number,
    parse_breakpoint_type,
    parse_maint_packet,
    parse_memory,
    parse_register_values,
    parse_remote_registers,
    parse_stopped,
    parse_thread_info,
    result_payload,
)
from qprobe.vmm.gdbremote import BREAK_HW, BREAK_SW, WATCH_ACCESS, WATCH_READ, WATCH_WRITE
from qprobe.vmm.rsp import StopReply
from qprobe.vmm.tdesc import RegDesc

_WATCH_FLAGS = {WATCH_WRITE: "", WATCH_READ: "-r ", WATCH_ACCESS: "-a "}
# ``-break-info`` types of watchpoints QEMU checks; a plain "watchpoint" is gdb single-stepping the VM.
_HW_WATCH_TYPES = frozenset({"hw watchpoint", "read watchpoint", "acc watchpoint"})
# Console commands that would end or replace the session under our feet.
_SESSION_COMMANDS = frozenset({"quit", "q", "kill", "k", "detach", "disconnect", "target", "tar"})


class PhysicalMode:
    """QEMU's ``Qqemu.PhyMemMode`` switched behind gdb's back: m/M take guest-physical addresses.

    gdb reads memory itself at every stop (to describe the frame), with the virtual addresses it finds in
    registers: so the mode asked for (``wanted``) is applied lazily, at the next memory access of ours, and
    turned off before each resume and before anything gdb reads on its own.
    """

    def __init__(self, request: Callable[[bytes], bytes]) -> None:
        self.request = request
        self.on = False  # the mode QEMU is in
        self.wanted = False  # the mode our next memory access needs

    def apply(self, on: bool) -> None:
        if self.on != on:
            reply = self.request(b"Qqemu.PhyMemMode:%d" % on)
            if reply != b"OK":
                raise TargetError(f"gdbstub refused physical memory mode: {reply[:40]!r}")
            self.on = on


class GdbMiRemote:
    """The gdb transport (``GdbTransport``) through a gdb process.  A single thread must own an instance.

    ``address`` is what ``Connection.open`` takes (``unix:PATH``, ``PATH`` or
    ``HOST:PORT``).  ``vmlinux``, when given, is loaded with ``load_symbols``
    before connecting (at its link address; call ``load_symbols`` again with
    the KASLR slide once known).  qprobe itself only uses raw addresses.
    """

    def __init__(self, address: str, *, alive: Callable[[], bool] | None = None, vmlinux: str | Path | None = None,
                 gdb: str = "gdb", connect_timeout: int = 5) -> None:  # fmt: skip
        self.address = address
        self.conn = MiChannel(gdb, alive, address)
        self.regs: dict[str, RegDesc] = {}
        self.architecture = ""  # gdb's name of the target's architecture, from the stub's target description
        self.running = False
        self._target = gdb_address(address)
        self._connect_timeout = connect_timeout
        self._numbers: dict[str, int] = {}  # register name -> gdb's register number
        self._read_set: dict[int, str] = {}  # gdb number -> name, for read_registers
        self._read_args = ""
        self._tids: dict[str, str] = {}  # gdb thread id -> stub thread id (p1.N)
        self._gids: dict[str, str] = {}  # and back
        self._current: str | None = None  # gdb's selected thread, when we know it
        self._phys = PhysicalMode(self.request)
        self._breakpoints: dict[tuple[int, int, int], list[str]] = {}  # (kind, addr, length) -> gdb numbers
        self._watches: dict[str, int] = {}  # gdb watchpoint number -> watched address
        try:
            for setting in ("mi-async on", "pagination off", "width 0", "height 0", "confirm off", "non-stop off"):
                self.conn.command(f"-gdb-set {setting}")
            # The architecture is the one the stub's target description names (gdb reads it on connecting).
            for cli in ("set auto-load off", "set osabi none",
                        "set breakpoint always-inserted on", "set stack-cache off", "set code-cache off",
                        "set remotetimeout 20", "set print thread-events off",
                        f"set tcp connect-timeout {connect_timeout}"):  # fmt: skip
                self._cli(cli)
            if vmlinux is not None:
                self.load_symbols(vmlinux, 0)
        except BaseException:
            self.conn.close()
            raise

    # -- set-up ------------------------------------------------------------------------------
    def handshake(self) -> StopReply:
        """Connect gdb to the stub, learn registers and vCPUs, return the current stop state.

        gdb retries a refused TCP connection for ``connect_timeout`` seconds
        (``tcp connect-timeout``), as Connection.open does; failing that, the
        error is TargetGone like Connection.open's.
        """
        token = self.conn.send(f"-target-select remote {self._target}")
        record = self.conn.result(token, "connecting gdb to the gdbstub", self._connect_timeout + 30)
        if record.get("message") == "error":
            msg = one_line(str((record.get("payload") or {}).get("msg", ""))) or "no message"
            raise TargetGone(f"cannot connect to the gdbstub at {self.address}: {msg}")
        result_payload(record, "connecting gdb to the gdbstub")
        # Connecting stops a running VM; gdb reports that stop before ^connected.
        stopped = self.conn.next_stop(0)
        self._cli("set scheduler-locking step")  # refused before there is a target
        self.regs, self._numbers = parse_remote_registers(self._cli("maint print remote-registers"))
        self.architecture = parse_architecture(self._cli("show architecture"))
        # What GdbRemote.read_registers returns: everything up to 64 bits wide.
        self._read_set = {self._numbers[d.name]: d.name for d in self.regs.values() if d.bitsize <= 64}
        self._read_args = " ".join(str(n) for n in self._read_set)
        self.threads()
        self.running = False
        if stopped is None:
            raise ProtocolError("gdb connected without reporting where the VM stopped")
        return parse_stopped(stopped, self._tids)

    def load_symbols(self, vmlinux: str | Path, slide: int = 0, index_dir: str | Path | None = None) -> None:
        """Give gdb the kernel's symbols, moved by the KASLR slide (``symbol-file -o``).

        Only for people typing gdb commands (``console``): qprobe's own requests
        use raw addresses.  Without ``index_dir``, ELF symbols only (``-readnever``,
        0.2 s): ``info symbol``, ``x/i`` with names.  With it, the DWARF too, through
        gdb's index cache in that directory: ``info line``, ``ptype``, ``list``; about
        1 s once the cache holds this build, 20 s or more for the load that writes it.
        """
        path = shlex.quote(str(vmlinux))
        if index_dir is None:
            self._cli(f"symbol-file -readnever -o {slide:#x} {path}")
            return
        self._cli(f"set index-cache directory {shlex.quote(str(index_dir))}")
        self._cli("set index-cache enabled on")
        self._cli(f"symbol-file -o {slide:#x} {path}", timeout=600.0)

    def _cli(self, command: str, timeout: float = 30.0) -> str:
        """A gdb CLI command through MI; its console output."""
        result = self.conn.result(self.conn.send(f"-interpreter-exec console {mi_quote(command)}"), command, timeout)
        text = self.conn.console_text()
        result_payload(result, repr(command))
        if result.get("message") == "running":
            self.running = True
            self._current = None
        return text

    def console(self, command: str, timeout: float = 60.0) -> str:
        """Run one gdb CLI command (the shell's raw ``gdb CMD``) and return what it printed.

        Only while the VM is stopped (the stop loop's ``call``).  A command that
        resumes the VM (``stepi``, ``continue``) leaves ``running`` set, and the
        stop loop collects the stop as if ``cont``/``step`` had resumed it.
        Commands that end the session (quit, kill, detach, disconnect, target)
        are refused: they would pull the stub out from under qprobe.
        """
        words = command.split()
        if not words:
            return ""
        if words[0] in _SESSION_COMMANDS:
            raise TargetError(f"gdb command {words[0]!r} would end qprobe's session; use qprobe's detach/close")
        self._check_stopped(command)
        self._phys.apply(False)  # a person typing ``x/4gx ADDR`` means a virtual address
        self._current = None  # the command may select another thread or frame
        return self._cli(command, timeout)

    def _check_stopped(self, what: str) -> None:
        if self.running:
            raise TargetError(f"internal: request {what[:20]!r} sent while the VM runs")

    def request(self, payload: bytes) -> bytes:
        """One raw packet through gdb (``maint packet``) and its reply, like GdbRemote.request.

        gdb does not know what the packet did: fine for queries and QEMU's
        own ``Qqemu.*`` packets, wrong for anything that changes state gdb keeps.
        """
        self._check_stopped(repr(payload))
        try:
            text = payload.decode("ascii")
        except UnicodeDecodeError:
            raise TargetError(f"cannot send binary packet {payload[:20]!r} through gdb's maint packet") from None
        if not text.isprintable() or any(c in text for c in "$#}*"):
            # maint packet frames the text as it is: these would need the escaping putpkt does not do.
            raise TargetError(f"cannot send packet {payload[:20]!r} through gdb's maint packet")
        return parse_maint_packet(self._cli(f"maint packet {text}"))

    # -- threads = vCPUs ---------------------------------------------------------------------
    def threads(self) -> list[str]:
        self._check_stopped("-thread-info")
        payload = self.conn.command("-thread-info")
        pairs = parse_thread_info(payload)
        self._tids = dict(pairs)
        self._gids = {tid: gid for gid, tid in pairs}
        current = payload.get("current-thread-id")
        self._current = current if isinstance(current, str) else None
        return [tid for _, tid in pairs]

    def _gid(self, tid: str) -> str:
        if tid not in self._gids:
            self.threads()
            if tid not in self._gids:
                raise TargetError(f"gdb does not know vCPU thread {tid}")
        return self._gids[tid]

    def select(self, tid: str) -> None:
        """Make ``tid`` gdb's selected thread: gdb sends ``Hg`` for it before memory accesses."""
        gid = self._gid(tid)
        if self._current != gid:
            self._check_stopped("-thread-select")
            self.conn.command(f"-thread-select {gid}", f"selecting vCPU {tid}")
            self._current = gid

    # -- registers -------------------------------------------------------------------------
    def read_registers(self, tid: str) -> dict[str, int]:
        """Registers of frame 0 of ``tid`` (``--frame 0``: never an unwound frame a user selected)."""
        self._check_stopped("-data-list-register-values")
        gid = self._gid(tid)
        payload = self.conn.command(f"-data-list-register-values --thread {gid} --frame 0 x {self._read_args}",
                                    f"reading the registers of vCPU {tid}")  # fmt: skip
        return parse_register_values(payload, self._read_set)

    def write_registers(self, tid: str, values: dict[str, int]) -> None:
        """One C comma expression (``$rip=..,$rsp=..``): one MI command per call, one ``P`` packet per register.

        Each MI command costs gdb a thread switch and a new frame 0, which is
        most of the time a separate command per register would take.
        """
        if not values:
            return
        self._check_stopped("register write")
        gid = self._gid(tid)
        parts = []
        for name, value in values.items():
            d = self.regs[name]  # KeyError for an unknown name, as GdbRemote
            parts.append(f"(${name}={value & ((1 << d.bitsize) - 1):#x})")
        expr = mi_quote(",".join(parts))
        what = f"writing registers {', '.join(values)} of vCPU {tid}"
        self.conn.command(f"-data-evaluate-expression --thread {gid} --frame 0 {expr}", what)

    # -- memory ----------------------------------------------------------------------------
    def set_physical(self, on: bool) -> None:
        """``Qqemu.PhyMemMode``: m/M take guest-physical addresses (from the next access on: PhysicalMode)."""
        self._phys.wanted = on

    def read_memory(self, addr: int, size: int) -> bytes:
        self._check_stopped("-data-read-memory-bytes")
        if size == 0:
            return b""
        self._phys.apply(self._phys.wanted)
        token = self.conn.send(f"-data-read-memory-bytes {addr:#x} {size}")
        record = self.conn.result(token, f"reading guest memory at {addr:#x}")
        if record.get("message") == "error":
            msg = one_line(str((record.get("payload") or {}).get("msg", "")))
            raise TargetError(f"cannot read guest memory at {addr:#x}: {msg}")
        return parse_memory(result_payload(record, "-data-read-memory-bytes"), addr, size)

    def write_memory(self, addr: int, data: bytes) -> None:
        self._check_stopped("-data-write-memory-bytes")
        if not data:
            return
        self._phys.apply(self._phys.wanted)
        self.conn.command(f"-data-write-memory-bytes {addr:#x} {data.hex()}", f"writing guest memory at {addr:#x}")

    # -- breakpoints -------------------------------------------------------------------------
    def insert_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        """gdb breakpoints and watchpoints: ``Z0``..``Z4`` on the wire.

        A watchpoint watches ``*(unsigned char (*)[length]) addr``.  One
        difference from the raw stub: gdb compares a write watchpoint's value
        itself and resumes without reporting a write that left it unchanged.
        gdb reads that value in virtual mode, so physical mode is turned off first.
        """
        self._check_stopped("-break-insert")
        what = f"{'breakpoint' if kind in (BREAK_SW, BREAK_HW) else 'watchpoint'} at {addr:#x}"
        if kind in (BREAK_SW, BREAK_HW):
            payload = self.conn.command(f"-break-insert {'-h ' if kind == BREAK_HW else ''}*{addr:#x}", what)
            number = parse_breakpoint_number(payload)
        elif kind in _WATCH_FLAGS:
            self._phys.apply(False)
            expr = mi_quote(f"*(unsigned char (*)[{length}]) {addr:#x}")
            number = parse_breakpoint_number(self.conn.command(f"-break-watch {_WATCH_FLAGS[kind]}{expr}", what))
            kind_name = parse_breakpoint_type(self.conn.command(f"-break-info {number}", what))
            if kind_name not in _HW_WATCH_TYPES:
                self.conn.command(f"-break-delete {number}", what)
                raise TargetError(f"gdb would watch {addr:#x} by single-stepping the VM ({kind_name}), not via QEMU")
            self._watches[number] = addr
        else:
            raise TargetError(f"unknown breakpoint kind {kind} at {addr:#x}")
        self._breakpoints.setdefault((kind, addr, length), []).append(number)

    def remove_breakpoint(self, addr: int, kind: int = BREAK_SW, length: int = 1) -> None:
        self._check_stopped("-break-delete")
        numbers = self._breakpoints.get((kind, addr, length))
        if not numbers:
            raise TargetError(f"gdbstub refused removing breakpoint at {addr:#x}: no such breakpoint")
        self.conn.command(f"-break-delete {numbers[-1]}", f"removing breakpoint at {addr:#x}")
        self._watches.pop(numbers.pop(), None)
        if not numbers:
            del self._breakpoints[(kind, addr, length)]

    # -- execution ---------------------------------------------------------------------------
    def cont(self) -> None:
        """Resume every vCPU.  A no-op if a console command already resumed the VM."""
        if self.running:
            return
        self._phys.apply(False)
        self.conn.command("-exec-continue", "continuing")
        self.running = True
        self._current = None

    def step(self, tid: str, timeout: float = 10.0) -> StopReply:
        """Single-step one vCPU; the others stay stopped (scheduler-locking step: ``vCont;s:TID``)."""
        self._check_stopped("-exec-step-instruction")
        gid = self._gid(tid)
        self._phys.apply(False)
        self.conn.command(f"-exec-step-instruction --thread {gid}", f"stepping vCPU {tid}")
        self.running = True
        self._current = None
        return self.wait_stop(timeout)

    def interrupt(self) -> None:
        """Stop a running VM; the stop arrives through wait_stop/poll_stop."""
        try:
            self.conn.command("-exec-interrupt", "interrupting the VM")
        except TargetError:
            # The VM stopped on its own just before: that stop is what the caller will wait for.
            if not self.conn.stops:
                raise

    def _stopped(self, payload: Mapping[str, Any]) -> StopReply:
        self.running = False
        gid = payload.get("thread-id")
        if isinstance(gid, str) and gid not in self._tids:
            self.threads()  # a vCPU gdb learned of only now (hot-plug): refresh the map
        # gdb selects the thread that stopped (all-stop); select() asks again rather than rely on it.
        self._current = None
        return parse_stopped(payload, self._tids, self._watches)

    def wait_stop(self, timeout: float | None = 10.0) -> StopReply:
        payload = self.conn.next_stop(timeout)
        if payload is None:
            raise GuestTimeout(f"the VM did not stop within {timeout:g} s")
        return self._stopped(payload)

    def poll_stop(self, timeout: float, wake: int | None = None) -> StopReply | None:
        payload = self.conn.next_stop(timeout, wake)
        return None if payload is None else self._stopped(payload)

    def close(self) -> None:
        """End gdb at once, sending nothing (see MiChannel.close)."""
        self.conn.close()

    def detach(self) -> None:
        """Detach (the VM runs on without us) and end gdb."""
        try:
            if not self.running and self.conn.gone is None:
                self._phys.apply(False)
                self.conn.expect_exit = True
                self.conn.command("-target-detach", "detaching", 5.0)
                try:
                    self.conn.command("-gdb-exit", "exiting gdb", 5.0)
                except TargetGone:
                    pass  # gdb may exit before we read its ^exit
        finally:
            self.conn.close()


__all__ = ["GdbMiRemote"]
