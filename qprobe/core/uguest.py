"""Uprobes counted in the guest: the kernel's own uprobe_register() with a consumer of qprobe's.

A probe with nothing to run on the host at its hits (no handler, filter or ret_handler) needs no VM stop:
qprobe has the guest register a ``struct uprobe_consumer`` in the scratch area, whose handler counts the hit
in guest RAM and returns 0.  The kernel's uprobes do the rest as for its own uprobe_events: the breakpoint
goes into a private copy of the page for each mm (``uprobe_write_opcode``), so the file and its page cache
never change; fork, exec, mmap, munmap and a file replaced behave as the kernel makes them; the instruction
runs out of line in the process's ``[uprobes]`` area.  The hits are the kernel's count, the one its
uprobe_profile shows for a trace_uprobe on the same instruction.

The calls are guest calls (qprobe.core.guestcall) of the kernel's exported API, whose shape changed in 6.12:

* up to 6.11, ``int uprobe_register(inode, offset, uc)`` and ``uprobe_unregister(inode, offset, uc)``;
* 6.12 on, ``struct uprobe *uprobe_register(inode, offset, ref_ctr_offset, uc)`` and
  ``uprobe_unregister_nosync(uprobe, uc)`` then ``uprobe_unregister_sync()`` ("uprobes: make
  uprobe_register() return struct uprobe *", "uprobes: split uprobe_unregister() further"),

told apart by which of them this kernel has.  The file's inode is held (``igrab``) while it is probed, as
trace_uprobe holds its path.  Every registration is journaled before it is made (the consumer's handler
field, "uconsumer"), with the inode, offset and 6.12's handle beside the consumer, so that the next attach
after a killed qprobe unregisters it before the scratch area goes (qprobe.core.recovery).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qprobe.arch import Arch
from qprobe.arch.guestcall import BLOCK_QUEUE
from qprobe.arch.inguest import MapKey, MapSlot
from qprobe.core.guestcall import BareCalls, CallSite, GuestCaller, LastCall, signed
from qprobe.core.uprobe import Uprobe
from qprobe.errors import InvalidProbe, QprobeError, TargetError
from qprobe.kernel.program import KernelData
from qprobe.kernel.ufile import GuestFile
from qprobe.vmm.journal import Patch
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.scratch import ScratchArea
from qprobe.vmm.transport import GdbTransport

if TYPE_CHECKING:
    from qprobe.core.optimizer import Optimizer

CONSUMER_MAX = 64  # bytes kept for struct uprobe_consumer (32 in 6.1 and 6.12)
C_COUNTER = CONSUMER_MAX  # u64: the handler's count
C_RETURNS = C_COUNTER + 8  # u64: the ret_handler's
C_INODE = C_RETURNS + 8  # the held inode
C_OFFSET = C_INODE + 8
C_HANDLE = C_OFFSET + 8  # 6.12's struct uprobe *, 1 before (registered)
C_STATE = C_HANDLE + 8  # the registration's step (below), written before the step's call is made
C_LOST = C_STATE + 8  # u64: hits a keyed handler found no free slot for
C_CODE = C_LOST + 16  # the handler's code (16-aligned): a keyed one's is a block of its own
C_RCODE = C_CODE + 16  # the ret_handler's
C_SIZE = C_RCODE + 16
KEYED_CODE_MAX = 2048  # bytes of a keyed handler (some hundreds for a key of several parts)
RECORD_CODE_MAX = 1024  # bytes of a recording handler (about 400: a fixed copy of the registers, then the ring's)
MAX_ERRNO = 4095  # include/linux/err.h: an ERR_PTR is one of the last 4095 addresses
# A registration's steps.  The state names the call made last (or being made); the guest call's done flag
# says whether it returned, and its result whether it worked: enough to finish a killed qprobe's.  S_NEW
# holds nothing of the kernel's: no call made yet, or a recovery finished the registration.
S_NEW, S_IGRAB, S_REGISTER, S_ARMED, S_UNREGISTER, S_SYNC, S_IPUT = range(7)
assert C_CODE % 16 == 0


@dataclass(frozen=True)
class UprobeApi:
    """The kernel's uprobe_register() family as this kernel has it."""

    returns_handle: bool  # 6.12 on: a struct uprobe * (or ERR_PTR), and the nosync/sync unregister pair

    def handle(self, ret: int) -> int:
        """What a registration keeps of uprobe_register()'s ``ret``: 6.12's struct uprobe *, else 1."""
        return ret if self.returns_handle else 1

    @property
    def unregister(self) -> tuple[str, ...]:
        return ("uprobe_unregister_nosync", "uprobe_unregister_sync") if self.returns_handle else ("uprobe_unregister",)


def uprobe_api(kernel: KernelData) -> UprobeApi | str:
    """The API, or why the kernel has none qprobe can call."""
    symbols = kernel.symbols
    if "uprobe_register" not in symbols or "igrab" not in symbols or "iput" not in symbols:
        return "the kernel has no uprobe_register() (CONFIG_UPROBES)"
    api = UprobeApi("uprobe_unregister_nosync" in symbols)
    missing = [name for name in api.unregister if name not in symbols]
    return f"the kernel has uprobe_register() but no {missing[0]}()" if missing else api


def errno_text(value: int) -> str:
    name = errno.errorcode.get(-value)
    return f"{name}: {os.strerror(-value)}" if name else f"error {value}"


def register_error(api: UprobeApi, ret: int) -> int:
    """The errno uprobe_register() returned in ``ret`` (0: it registered the consumer)."""
    if api.returns_handle:
        value = signed(ret)
        return value if -MAX_ERRNO <= value < 0 else 0
    return ((ret & 0xFFFF_FFFF) ^ 0x8000_0000) - 0x8000_0000  # an int: only eax is the value


@dataclass
class Registration:
    """One consumer's block in the scratch area (its words), and the journal's record of it."""

    block: int
    patch: Patch | None
    inode: int = 0
    offset: int = 0
    handle: int = 0
    state: int = S_NEW
    keyed: tuple[int, int] | None = None  # a keyed handler's code and tables (allocated apart from the block)
    recorder: tuple[int, int] | None = None  # a recording handler's code (apart from the block) and probe id

    @classmethod
    def parse(cls, block: int, raw: bytes) -> Registration:
        """The words a killed qprobe left in the block (``raw``: C_SIZE bytes of it)."""
        inode, offset, handle, state = (int.from_bytes(raw[at : at + 8], "little")
                                        for at in (C_INODE, C_OFFSET, C_HANDLE, C_STATE))  # fmt: skip
        return cls(block, None, inode, offset, handle, state)


Call = Callable[..., int]  # a guest call: (function name, *arguments) -> its return value


STEP_CALL = {S_IGRAB: "igrab", S_REGISTER: "uprobe_register", S_SYNC: "uprobe_unregister_sync", S_IPUT: "iput"}


def step_call(api: UprobeApi, state: int) -> str | None:
    """The function the step ``state`` calls (None: S_NEW and S_ARMED call none)."""
    return api.unregister[0] if state == S_UNREGISTER else STEP_CALL.get(state)


def take_out(call: Call, api: UprobeApi, reg: Registration, done: bool, ret: int,
             step: Callable[[int], None]) -> None:  # fmt: skip
    """Finish a registration from ``reg.state`` on: the consumer unregistered if it is registered, the inode
    let go if it is held.  ``done``/``ret``: whether the state's own call was made (a killed qprobe's may not
    have been; one the guest queued is waited for first), and what it returned; ``step(state)`` records each
    step before its call is made."""
    state, inode, consumer = reg.state, reg.inode, reg.block
    if not done and state in (S_UNREGISTER, S_SYNC, S_IPUT):
        state -= 1  # the step before is where the registration is (6.1's S_IPUT follows its unregister: no sync)
    if state == S_IGRAB and done:
        inode = ret  # igrab's: held (or NULL) even if the host never wrote it down
    held = bool(inode) and state in (S_IGRAB, S_REGISTER, S_ARMED, S_UNREGISTER, S_SYNC)
    registered = state == S_ARMED or (state == S_REGISTER and done and not register_error(api, ret))
    handle = reg.handle if state != S_REGISTER else ret
    if registered:
        step(S_UNREGISTER)
        if api.returns_handle:
            call("uprobe_unregister_nosync", handle, consumer)
        else:
            call("uprobe_unregister", inode, reg.offset, consumer)
    if api.returns_handle and (registered or state == S_UNREGISTER):
        # The consumer's handler may run until the sync returns (SRCU): only then may its block go.
        step(S_SYNC)
        call("uprobe_unregister_sync")
    if held:
        step(S_IPUT)
        call("iput", inode)


def left_call(api: UprobeApi, reg: Registration, last: LastCall, address: Callable[[str], int]) -> tuple[bool, int]:
    """Whether a killed qprobe made the call of ``reg``'s state, and what it returned (take_out's ``done`` and
    ``ret``), from the guest-call block's ``last`` call (done, if it was queued).  That call is the state's
    only if it is both this registration's (its tag) and the state's function: the state is written before
    its call, so the block may still hold this registration's previous call, or another registration's."""
    name = step_call(api, reg.state)
    if name is None:
        return True, 0
    if last.tag != reg.block or last.fn != address(name) or not last.queued:
        return False, 0  # never made (one written but not queued never will be: the next call overwrites it)
    return True, last.ret


class GuestUprobes:
    """Count-only uprobes registered with the guest kernel's uprobes (see the module's docstring)."""

    def __init__(self, machine: Machine, kernel: KernelData, scratch: ScratchArea, arch: Arch,
                 ram: SharedRam | None, optimizer: Optimizer | None = None) -> None:  # fmt: skip
        """``optimizer``: whose record rings a recording probe's handler writes (none: no probe records)."""
        self.machine, self.kernel, self.scratch, self.arch, self.ram = machine, kernel, scratch, arch, ram
        self.optimizer = optimizer
        self.caller = GuestCaller(machine, kernel, scratch, arch, ram)
        self.registered: dict[Uprobe, Registration] = {}
        self._lock = threading.Lock()
        # One registration or unregistration at a time: a killed qprobe's block then says whose call was last.
        self._seq = threading.Lock()
        self._api: UprobeApi | str | None = None

    @property
    def unavailable(self) -> str | None:
        """Why uprobes cannot be counted in this guest (None: they can)."""
        if self.caller.unavailable is not None:
            return self.caller.unavailable
        if self._api is None:
            self._api = uprobe_api(self.kernel)
        if isinstance(self._api, str):
            return self._api
        try:
            size = self.kernel.prog.type("struct uprobe_consumer").size
        except LookupError as exc:
            return f"struct uprobe_consumer is not known: {exc}"
        if size is None or size > CONSUMER_MAX:
            return f"struct uprobe_consumer is {size} bytes here, more than qprobe's {CONSUMER_MAX}"
        return None

    @property
    def records_unavailable(self) -> str | None:
        """Why a probe's hits cannot be recorded into the rings here (None: they can)."""
        opt = self.optimizer
        if opt is None or not opt.available or opt.records is None:
            return "the record rings need qprobe's own QEMU (a doorbell device and shared RAM)"
        return self.unavailable or opt.stub_missing()

    def register(self, up: Uprobe, f: GuestFile, offset: int) -> None:
        """``up`` registered with the guest's uprobes at ``offset`` of ``f`` (any thread but the stop loop's)."""
        with self._seq:
            self._register(up, f, offset)

    def _register(self, up: Uprobe, f: GuestFile, offset: int) -> None:
        api = self._api
        gc = self.arch.guest_call
        assert isinstance(api, UprobeApi) and gc is not None and self.ram is not None  # unavailable said None
        handler_off = self.kernel.type_offset("struct uprobe_consumer", "handler")
        block = self._alloc(C_SIZE, 64)
        image = bytearray(C_SIZE)
        code = gc.build_count_handler(block + C_CODE, block + C_COUNTER)
        image[C_CODE : C_CODE + len(code)] = code
        assert up.guest_key is None or up.recorder is None  # a probe folds its hits or records them
        returns = up.ret_handler is not None  # a return probe: the kernel takes the return too (its return_instance)
        try:
            keyed = self._keyed(up, block) if up.guest_key is not None else None
            recorder = self._recorder(up, block + (C_RETURNS if returns else C_COUNTER), returns)
        except QprobeError:
            self.machine.call(lambda: self.scratch.free(block))
            raise
        entry = keyed[0] if keyed is not None else block + C_CODE
        if recorder is not None and not returns:
            entry = recorder[0]
        if returns:
            ret_off = self.kernel.type_offset("struct uprobe_consumer", "ret_handler")
            code = gc.build_count_handler(block + C_RCODE, block + C_RETURNS)
            image[C_RCODE : C_RCODE + len(code)] = code
            ret = block + C_RCODE if recorder is None else recorder[0]
            image[ret_off : ret_off + 8] = ret.to_bytes(8, "little")
        self.machine.call(lambda: self.scratch.write(block, bytes(image)))
        self._write(block + C_OFFSET, offset)
        # Journaled before the kernel knows the consumer: a kill from here on is finished by the next attach.
        handler = entry.to_bytes(8, "little")
        patch = self.machine.call(lambda: self.machine.patch(block + handler_off, handler, "uconsumer"))
        reg = Registration(block, patch, offset=offset, keyed=keyed, recorder=recorder)
        # A refusal frees the block; a call that failed otherwise (the guest did not complete it) leaves it,
        # journaled, to the next attach: the kernel may still register the consumer.
        call = self._calls(reg)
        self._step(reg, S_IGRAB)
        reg.inode = call("igrab", f.inode)
        self._write(block + C_INODE, reg.inode)
        if not reg.inode:
            self._forget(reg)
            raise InvalidProbe(f"{up.where()}: the guest is freeing {f.path}'s inode (igrab() failed)")
        self._step(reg, S_REGISTER)
        args = (reg.inode, offset, 0, block) if api.returns_handle else (reg.inode, offset, block)
        ret = call("uprobe_register", *args)
        error = register_error(api, ret)
        if error:
            take_out(call, api, reg, True, ret, lambda state: self._step(reg, state))
            self._forget(reg)
            raise InvalidProbe(f"{up.where()}: the guest's uprobe_register() refused it ({errno_text(error)})")
        reg.handle = api.handle(ret)
        self._write(block + C_HANDLE, reg.handle)
        self._step(reg, S_ARMED)
        with self._lock:
            self.registered[up] = reg
        before = (up.nhit, up.nreturns)  # counts of earlier registrations of the same Uprobe
        up.guest_counts = lambda: (before[0] + self._count(reg, C_COUNTER), before[1] + self._count(reg, C_RETURNS))

    def unregister(self, up: Uprobe) -> None:
        """``up`` taken out of the guest's uprobes; ``nhit`` keeps its last count."""
        api = self._api
        assert isinstance(api, UprobeApi)
        with self._seq:
            with self._lock:
                reg = self.registered.pop(up)
            take_out(self._calls(reg), api, reg, True, 0, lambda state: self._step(reg, state))
        last = up.nhit, up.nreturns
        up.guest_counts = None
        up.nhit, up.nreturns = last  # kept
        up.nlost += self._forget(reg)

    def _keyed(self, up: Uprobe, block: int) -> tuple[int, int]:
        """A keyed handler for ``up.guest_key`` (stop-loop thread work done through calls): its code and its
        zeroed per-CPU tables."""
        spec, gc, layouts = up.guest_key, self.arch.guest_call, self.arch.guest_ram
        assert spec is not None and gc is not None and layouts is not None and self.ram is not None
        size = layouts.guest_map_size(spec) * len(self.machine.vcpus)
        tables = self._alloc(size, 4096)  # written by the guest: apart from code
        self.ram.write_phys(self.scratch.phys_of(tables), bytes(size))
        current, pid, _tgid, comm = self.kernel.offsets
        code = self._alloc(KEYED_CODE_MAX, 16)
        built = gc.build_keyed_handler(code, spec, tables, self.kernel.percpu_offset("cpu_number"),
                                       (current, pid, comm), block + C_COUNTER, block + C_LOST)  # fmt: skip
        if len(built) > KEYED_CODE_MAX:

            def drop() -> None:
                self.scratch.free(code)
                self.scratch.free(tables)

            self.machine.call(drop)
            raise InvalidProbe(f"{up.where()}: a key of {len(spec.parts)} parts makes a {len(built)}-byte handler")
        self.machine.call(lambda: self.scratch.write(code, built))
        return code, tables

    def _recorder(self, up: Uprobe, counter: int, returns: bool) -> tuple[int, int] | None:
        """For a probe with a recorder, a handler recording its hits (its returns) into the optimizer's rings and
        counting them at ``counter``: its code, and its probe id there (stop-loop work done through calls)."""
        deliver, opt = up.recorder, self.optimizer
        if deliver is None:
            return None
        assert opt is not None and opt.records is not None
        records = opt.records
        code = self._alloc(RECORD_CODE_MAX, 16)
        try:
            probe_id = self.machine.call(lambda: opt.open_recorder(up, deliver))
        except QprobeError:  # no id left, or no room for the rings
            self.machine.call(lambda: self.scratch.free(code))
            raise
        built = records.handler_code(probe_id, counter, returns, code)
        assert len(built) <= RECORD_CODE_MAX, f"internal: a {len(built)}-byte record handler"
        self.machine.call(lambda: self.scratch.write(code, built))
        return code, probe_id

    def _alloc(self, size: int, align: int) -> int:
        """``size`` bytes of the scratch area (mapped first if it is not yet)."""

        def alloc() -> int:
            self.scratch.ensure_mapped()
            return self.scratch.alloc(size, align=align)

        return self.machine.call(alloc)

    def keyed_counts(self, up: Uprobe) -> dict[MapKey, MapSlot]:
        """``up``'s in-guest map so far (``up.guest_key``'s), summed over the CPUs' tables (RAM reads, no stop)."""
        reg, spec, layouts = self.registered.get(up), up.guest_key, self.arch.guest_ram
        if reg is None or reg.keyed is None or spec is None or layouts is None or self.ram is None:
            return {}
        size = layouts.guest_map_size(spec) * len(self.machine.vcpus)
        return layouts.parse_guest_map(spec, self.ram.read_phys(self.scratch.phys_of(reg.keyed[1]), size))

    def _count(self, reg: Registration, counter: int) -> int:
        assert self.ram is not None
        return self.ram.read_u64_phys(self.scratch.phys_of(reg.block + counter))

    def _write(self, addr: int, value: int) -> None:
        assert self.ram is not None
        self.ram.write_phys(self.scratch.phys_of(addr), value.to_bytes(8, "little"))

    def _calls(self, reg: Registration) -> Call:
        return lambda name, *args: self.caller.call(name, *args, tag=reg.block)

    def _step(self, reg: Registration, state: int) -> None:
        reg.state = state
        self._write(reg.block + C_STATE, state)

    def _forget(self, reg: Registration) -> int:
        """The registration's scratch space freed (the kernel calls none of its handlers any more): the records
        its recorder lost on a full ring."""
        patch = reg.patch
        assert patch is not None

        def drop() -> int:
            self.machine.unpatch(patch)
            self.scratch.free(reg.block)
            for addr in reg.keyed or ():
                self.scratch.free(addr)
            if reg.recorder is None or self.optimizer is None:
                return 0
            code, probe_id = reg.recorder
            self.scratch.free(code)
            return self.optimizer.close_recorder(probe_id)

        try:
            lost = self.machine.call(drop)
            if not self.registered:
                self.caller.release()
            return lost
        except TargetError:
            return 0  # the VM is gone: nothing of it to forget


def _finish(calls: BareCalls, api: UprobeApi, reg: Registration, done: bool, ret: int) -> None:
    """take_out through the bare gdbstub, recorded as a live qprobe's is: a recovery killed in turn is
    finished by the next."""
    block = reg.block
    # What the killed qprobe had not written down yet, as it would have: a later step forgets ``ret``.
    if done and reg.state == S_IGRAB:
        reg.inode = ret
    elif done and reg.state == S_REGISTER and not register_error(api, ret):
        reg.handle = api.handle(ret)
    calls.write(block + C_INODE, b"".join(w.to_bytes(8, "little") for w in (reg.inode, reg.offset, reg.handle)))

    def step(state: int) -> None:
        calls.write(block + C_STATE, state.to_bytes(8, "little"))

    take_out(lambda name, *args: calls(name, *args, tag=block), api, reg, done, ret, step)
    step(S_NEW)  # finished: nothing of the kernel's held any more


def finish_left(gdb: GdbTransport, kernel: KernelData, arch: Arch, patches: list[Patch]) -> int:
    """Finish every registration a killed qprobe left (its journal's "uconsumer" records) through the bare
    gdbstub, with the kernel text already restored (the VM runs for each call); how many.

    The guest-call block says whose call was last, whether the queue stub ran it and whether it returned:
    a call it queued is waited for, one it never queued was not made (:func:`left_call`)."""
    left = [p for p in patches if p.what == "uconsumer"]
    if not left:
        return 0
    api = uprobe_api(kernel)
    found = next((p for p in patches if p.what == "guestcall"), None)
    if isinstance(api, str) or found is None or arch.guest_call is None:
        why = api if isinstance(api, str) else "its guest-call code is not in the journal"
        raise QprobeError(f"the uprobes an earlier qprobe registered in this guest cannot be taken out: {why}")
    calls = BareCalls(gdb, kernel, arch, CallSite(found.virt - BLOCK_QUEUE,
                                                  kernel.symbols.address(arch.guest_call.interrupt_exit)))  # fmt: skip
    handler_off = kernel.type_offset("struct uprobe_consumer", "handler")
    last = calls.last()
    if last.queued and not last.done:
        # Waited for before any other call goes through the block (which would take its place).
        calls.wait_done()
        last = calls.last()
    regs = [Registration.parse(p.virt - handler_off, calls.read(p.virt - handler_off, C_SIZE)) for p in left]
    # The block's last call first: the others' calls replace it.  No other's state call was made (one
    # registration's calls at a time), or a recovery killed since finished that registration (S_NEW).
    for reg in sorted(regs, key=lambda r: r.block != last.tag):
        _finish(calls, api, reg, *left_call(api, reg, last, kernel.symbols.address))
    return len(left)


__all__ = [
    "GuestUprobes",
    "Registration",
    "UprobeApi",
    "finish_left",
    "left_call",
    "step_call",
    "take_out",
    "uprobe_api",
]
