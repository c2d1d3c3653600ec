"""What evaluation needs from a stopped guest, and the values it produces.

Evaluation runs on the host while the guest vCPU is stopped at the probe, so
everything the kernel's ``process_fetch_insn`` reads from ``pt_regs``, the
stack or memory comes through a :class:`FetchContext`.  A fault while
reading guest memory is part of normal operation (the kernel records it and
goes on), so it is a value, :data:`FAULT`, never an exception to callers.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from qprobe.errors import QprobeError

from .messages import MAX_STRING_SIZE

U64_MASK = (1 << 64) - 1
PAGE_SIZE = 4096


class MemoryFault(QprobeError):
    """A guest memory read failed (unmapped page, wrong address space...)."""

    def __init__(self, addr: int, size: int = 1) -> None:
        self.addr = addr
        self.size = size
        super().__init__(f"cannot read {size} byte(s) at {addr:#x}")


@runtime_checkable
class FetchContext(Protocol):
    """The guest state at one probe hit, as the fetch instructions see it.

    ``reg`` takes a pt_regs name the parser's Dialect accepted (its
    architecture's) and returns the full 64-bit pt_regs slot.
    ``read``/``read_user`` return exactly ``size`` bytes or raise
    :class:`MemoryFault`; the evaluator already refuses user addresses for
    ``read`` and kernel addresses for ``read_user`` (as x86's
    copy_from_kernel_nofault / copy_from_user_nofault do), so an
    implementation only has to report unmapped memory.  ``stack(n)`` is
    ``regs_get_kernel_stack_nth`` (0 past the stack top), ``arg(n)`` the
    1-based argument by the architecture's calling convention (its argument
    registers, then the stack), ``retval`` the return value (only asked for
    in return probes), ``comm`` the current task's comm, ``symbol_address``
    resolves ``@SYM`` (KeyError if unknown) and ``symbolize`` formats an
    address like the kernel's ``%pS`` (``func+0x12/0x80`` or ``0xffff...``).
    ``task_size_max`` is the running kernel's TASK_SIZE_MAX (the
    architecture's ``PageTables.task_size_max``).
    """

    task_size_max: int

    def reg(self, name: str) -> int: ...
    def read(self, addr: int, size: int) -> bytes: ...
    def read_user(self, addr: int, size: int) -> bytes: ...
    def stack(self, n: int) -> int: ...
    def stack_pointer(self) -> int: ...
    def retval(self) -> int: ...
    def comm(self) -> str: ...
    def arg(self, n: int) -> int: ...
    def symbol_address(self, name: str) -> int: ...
    def symbolize(self, addr: int) -> str: ...


@runtime_checkable
class UserFetchContext(FetchContext, Protocol):
    """A uprobe hit's state: a FetchContext whose registers are the user-mode ones, plus the probed file.

    ``file_address(offset)`` is trace_uprobe.c's ``translate_user_vaddr``: the
    address at which the probed file's byte ``offset`` is mapped in the hitting
    process (the probe's address minus the probe's file offset, plus ``offset``).
    """

    def file_address(self, offset: int) -> int: ...


class UprobeContext:
    """A uprobe hit as trace_uprobe.c's fetch functions see it, over the engine's :class:`UserFetchContext`.

    Every memory read is ``copy_from_user`` (trace_uprobe.c's probe_mem_read
    and fetch_store_string), so a kernel address faults; ``$stackN`` is
    ``get_user_stack_nth`` (the Nth word above the user stack pointer, 0 when
    it cannot be read) and ``$stack`` the user stack pointer.
    """

    def __init__(self, ctx: UserFetchContext) -> None:
        self._ctx = ctx
        self.task_size_max = ctx.task_size_max

    def reg(self, name: str) -> int:
        return self._ctx.reg(name)

    def read(self, addr: int, size: int) -> bytes:
        raise MemoryFault(addr, size)

    def read_user(self, addr: int, size: int) -> bytes:
        return self._ctx.read_user(addr, size)

    def stack(self, n: int) -> int:
        addr = (self.stack_pointer() + 8 * n) & U64_MASK
        try:
            return int.from_bytes(read_memory(self, addr, 8, True), "little")
        except MemoryFault:
            return 0

    def stack_pointer(self) -> int:
        return self._ctx.reg("sp")

    def retval(self) -> int:
        return self._ctx.retval()

    def comm(self) -> str:
        return self._ctx.comm()

    def arg(self, n: int) -> int:  # the parser refuses $argN in a uprobe
        raise KeyError(f"arg{n}")

    def symbol_address(self, name: str) -> int:  # the parser refuses @SYM in a uprobe
        raise KeyError(name)

    def symbolize(self, addr: int) -> str:
        return self._ctx.symbolize(addr)

    def file_address(self, offset: int) -> int:
        return self._ctx.file_address(offset)


class Fault:
    """The value of an argument whose memory could not be read."""

    _instance: Fault | None = None

    def __new__(cls) -> Fault:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "FAULT"

    def __str__(self) -> str:
        return "(fault)"

    def __bool__(self) -> bool:
        return False


FAULT = Fault()


class SymbolValue(int):
    """A ``:symbol`` value: the address, plus its ``%pS`` text for printing."""

    text: str

    def __new__(cls, value: int, text: str) -> SymbolValue:
        obj = super().__new__(cls, value)
        obj.text = text
        return obj

    def __repr__(self) -> str:
        return f"SymbolValue({int(self):#x}, {self.text!r})"


def kernel_address_ok(addr: int, task_size: int) -> bool:
    """``copy_from_kernel_nofault_allowed`` on x86_64: above the user range and its guard page, canonical.

    The kernel's canonical check uses ``x86_virt_bits`` (48 or 57); the lowest
    canonical kernel address is ``-(task_size + PAGE_SIZE)``.
    """
    start = task_size + PAGE_SIZE
    return addr >= (1 << 64) - start


def user_range_ok(addr: int, size: int, task_size: int) -> bool:
    """``access_ok`` on x86_64: the whole range below TASK_SIZE_MAX."""
    return addr + size <= task_size


def read_memory(ctx: FetchContext, addr: int, size: int, user: bool) -> bytes:
    """Read guest memory as the kernel's probe_mem_read{,_user} would.

    A kernel read (``+0(%si)``) of an address below TASK_SIZE reads user memory:
    x86 has non-overlapping address spaces (CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE),
    and trace_kprobe.c's ``probe_mem_read`` takes the user path for such an address.
    """
    addr &= U64_MASK
    task_size = ctx.task_size_max
    if user or addr < task_size:
        if not user_range_ok(addr, size, task_size):
            raise MemoryFault(addr, size)
        data = ctx.read_user(addr, size)
    else:
        if not kernel_address_ok(addr, task_size):
            raise MemoryFault(addr, size)
        data = ctx.read(addr, size)
    if len(data) != size:
        raise MemoryFault(addr, size)
    return data


def read_uint(ctx: FetchContext, addr: int, size: int, user: bool) -> int:
    """A little-endian unsigned integer of ``size`` bytes from guest memory."""
    return int.from_bytes(read_memory(ctx, addr, size, user), "little")


def read_string(ctx: FetchContext, addr: int, user: bool) -> str | Fault:
    """A NUL-terminated string, at most MAX_STRING_SIZE - 1 characters.

    Memory is read a page at a time so a short string near the end of a
    mapping does not fault on bytes past its NUL; a page that faults is
    retried byte by byte, and a fault before the NUL gives FAULT, as the
    kernel's strncpy_from_*_nofault does.  An empty string read from user
    memory is FAULT too: strncpy_from_user_nofault (mm/maccess.c) counts the
    NUL only of a non-empty string, so it returns 0 for one, and the kernel
    records a zero-length string, which it prints as ``(fault)``
    (strncpy_from_kernel_nofault counts the NUL: an empty kernel string is
    ``""``).  A uprobe's strings are read with strncpy_from_user, after which
    trace_uprobe.c's fetch_store_string counts the NUL itself: there an empty
    string is ``""``.  Bytes are decoded as UTF-8 with surrogateescape so the exact
    bytes can be recovered.
    """
    out = bytearray()
    addr &= U64_MASK
    # x86 has non-overlapping address spaces (CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE), so the
    # kernel's fetch_store_string() reads a ``string`` below TASK_SIZE from user memory.
    user = user or addr < ctx.task_size_max
    while len(out) < MAX_STRING_SIZE:
        chunk = min(PAGE_SIZE - addr % PAGE_SIZE, MAX_STRING_SIZE - len(out))
        try:
            data: bytes | bytearray = read_memory(ctx, addr, chunk, user)
        except MemoryFault:
            data = bytearray()
            for i in range(chunk):
                try:
                    byte = read_memory(ctx, addr + i, 1, user)
                except MemoryFault:
                    return FAULT
                data += byte
                if byte == b"\0":
                    break
        nul = data.find(0)
        if nul >= 0:
            out += data[:nul]
            empty_faults = user and not isinstance(ctx, UprobeContext)
            return FAULT if empty_faults and not out else _decode(out)
        out += data
        addr = (addr + chunk) & U64_MASK
    return _decode(out[: MAX_STRING_SIZE - 1])


def _decode(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", "surrogateescape")
