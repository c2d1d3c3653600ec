"""What the running kernel's tracefs would say about its kprobe_events language, read from vmlinux.

The kernel keeps the text of tracefs' ``README`` in ``readme_msg`` and its probe
parser's error texts in ``trace_probe_err_text`` (kernel/trace/trace.c and
trace_probe.c); both are static data of vmlinux, so qprobe reads them from the
file on the host before anything boots.  A kernel built without tracing has
neither: its Dialect is 6.1.0's.  The trace events the kernel has are live
data, read through drgn.
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Callable, Mapping, Sequence

import drgn
from drgn.helpers.linux.list import list_for_each_entry

from qprobe.errors import QprobeError
from qprobe.fetch.btf import CType, FuncProto, Member
from qprobe.fetch.dialect import Dialect, dialect_of
from qprobe.kernel.btf import KernelBtf
from qprobe.kernel.symbols import Symbols

_MAX_TEXT = 256  # longest error text read; the kernel's are under 80 characters


def _cstring(symbols: Symbols, addr: int, limit: int) -> str:
    raw = symbols.file_bytes(addr, limit)
    end = raw.find(b"\0")
    return raw[: end if end >= 0 else len(raw)].decode("utf-8", "replace")


def _section_room(symbols: Symbols, addr: int) -> int:
    sec = symbols.section_at(addr)
    return 0 if sec is None else sec.addr + sec.size - (addr - symbols.slide)


def readme(symbols: Symbols) -> str | None:
    """The tracefs README text of this kernel, or None if it has none."""
    if "readme_msg" not in symbols:
        return None
    sym = symbols.lookup("readme_msg")
    try:
        return _cstring(symbols, sym.addr, sym.size or _section_room(symbols, sym.addr))
    except QprobeError:
        return None


def error_texts(symbols: Symbols) -> list[str] | None:
    """The probe parser's error texts (``trace_probe_err_text``: an array of string pointers), or None."""
    if "trace_probe_err_text" not in symbols:
        return None
    sym = symbols.lookup("trace_probe_err_text")
    try:
        pointers = struct.unpack(f"<{sym.size // 8}Q", symbols.file_bytes(sym.addr, sym.size - sym.size % 8))
        # The file holds link-time addresses; symbols' addresses are running ones.
        return [_cstring(symbols, p + symbols.slide, min(_MAX_TEXT, _section_room(symbols, p + symbols.slide)))
                for p in pointers]  # fmt: skip
    except (QprobeError, struct.error):
        return None


# The loaded modules' BTF blobs, (address of the kernel's struct btf, raw BTF) each: qprobe.kernel.btf.module_btfs.
ModuleBtfs = Callable[[], list[tuple[int, bytes]]]


class _LazyBtf:
    """The kernel's BTF, read from vmlinux the first time the parser asks for it, then the modules'.

    ``modules`` lists the loaded modules' BTF blobs over the live guest; each is parsed once,
    keyed by its address and its bytes (a module that unloads frees its ``struct btf``, and
    the next module's may get the same address).
    """

    def __init__(self, symbols: Symbols, modules: ModuleBtfs | None) -> None:
        self._symbols = symbols
        self._modules = modules
        self._parsed: dict[tuple[int, bytes], KernelBtf | None] = {}

    @functools.cached_property
    def _btf(self) -> KernelBtf | None:
        return KernelBtf.of(self._symbols)

    def _module_btf(self, key: tuple[int, bytes]) -> KernelBtf | None:
        if key not in self._parsed:
            try:
                self._parsed[key] = KernelBtf(key[1], base=self._btf)
            except (QprobeError, struct.error):
                self._parsed[key] = None
        return self._parsed[key]

    def proto(self, func: str) -> FuncProto | None:
        """``bpf_find_btf_id``: vmlinux's BTF first, then each loaded module's."""
        if self._btf is None:
            return None
        found = self._btf.proto(func)
        if found is not None or self._modules is None:
            return found
        loaded = self._modules()
        for key in set(self._parsed) - set(loaded):
            del self._parsed[key]  # unloaded since
        for key in loaded:
            btf = self._module_btf(key)
            found = None if btf is None else btf.proto(func)
            if found is not None:
                return found
        return None

    def offsetof(self, struct: str, path: str) -> int | None:
        return None if self._btf is None else self._btf.offsetof(struct, path)

    def member(self, parent: CType, name: str) -> Member | None:
        btf = parent.btf or self._btf
        return None if btf is None else btf.member(parent, name)


def probe_dialect(symbols: Symbols, registers: Mapping[str, str], thread_size: int | None = None,
                  modules: ModuleBtfs | None = None) -> Dialect:  # fmt: skip
    """The kprobe_events Dialect of the kernel ``symbols`` describes, with its THREAD_SIZE if known.

    ``registers`` is its architecture's regoffset_table (``RegisterLayout.regoffset_table``:
    each ``%REG`` name with the pt_regs field it reads); ``modules`` gives the loaded
    modules' BTF (none before a guest is attached).
    """
    return dialect_of(readme(symbols), error_texts(symbols), thread_size, _LazyBtf(symbols, modules), registers)


def trace_event_names(prog: drgn.Program) -> frozenset[tuple[str, str]]:
    """(system, name) of every trace event the running kernel has (its ``ftrace_events`` list).

    A kprobe event cannot take one of these names (``trace_probe_register_event_call``
    refuses it with -EEXIST).  ``trace_event_name()``: a tracepoint event keeps its
    name in ``call->tp`` (``TRACE_EVENT_FL_TRACEPOINT``), the others in ``call->name``;
    ``TRACE_EVENT_FL_CUSTOM`` (Linux 5.18) events keep it in ``call->name`` too.
    """
    try:
        events = prog["ftrace_events"]
        tracepoint = prog.constant("TRACE_EVENT_FL_TRACEPOINT").value_()
    except LookupError:
        return frozenset()  # a kernel without CONFIG_TRACING has no trace events to clash with
    try:
        custom = prog.constant("TRACE_EVENT_FL_CUSTOM").value_()
    except LookupError:
        custom = 0
    out = set()
    for call in list_for_each_entry("struct trace_event_call", events.address_of_(), "list"):
        flags = call.flags.value_()
        name = call.tp.name if flags & tracepoint and not flags & custom else call.name
        if name and call.member_("class"):
            out.add((call.member_("class").system.string_().decode(), name.string_().decode()))
    return frozenset(out)


def ftrace_locations(symbols: Symbols) -> list[int]:
    """Running addresses of every ``__fentry__`` call site ftrace manages (the ``__mcount_loc`` table), sorted.

    Empty for a kernel without dynamic ftrace.  The table holds link-time addresses.
    """
    if "__start_mcount_loc" not in symbols or "__stop_mcount_loc" not in symbols:
        return []
    lo, hi = symbols.address("__start_mcount_loc"), symbols.address("__stop_mcount_loc")
    try:
        raw = symbols.file_bytes(lo, hi - lo)
    except QprobeError:
        return []
    return sorted(a + symbols.slide for (a,) in struct.iter_unpack("<Q", raw[: len(raw) - len(raw) % 8]) if a)


# What ftrace_record_ips reads at most, in records (vmlinux has some 50,000, a distribution's modules as
# many again).
MAX_FTRACE_RECORDS = 1 << 20


def ftrace_record_ips(prog: drgn.Program) -> frozenset[int]:
    """The instruction of every call site the guest's ftrace manages, vmlinux's and loaded modules' alike: each
    ``struct dyn_ftrace``'s ``ip`` in the ``ftrace_pages_start`` list (kernel/trace/ftrace.c), which the
    kernel's check_ftrace_location compares a kprobe's address with.

    From the running kernel, because arm64's ``__mcount_loc`` is init data filled by relocation at boot, and
    its records point past the entry (ftrace_call_adjust).  Empty without dynamic ftrace.
    """
    try:
        page = prog["ftrace_pages_start"]
        rec_type = prog.type("struct dyn_ftrace")
    except (KeyError, LookupError):
        return frozenset()
    size, ip_off = drgn.sizeof(rec_type), rec_type.member("ip").offset
    try:
        page_size: int | None = prog["PAGE_SIZE"].value_()
    except KeyError:  # not from vmcoreinfo: the budget alone bounds each read
        page_size = None
    ips: set[int] = set()
    seen = 0
    # Bounded: a page's ``index`` (its records) and ``order`` (its size) come from the guest, so neither may
    # make the host read past the page or more records than the budget has left.
    while page.value_() and seen < MAX_FTRACE_RECORDS:
        room = (MAX_FTRACE_RECORDS - seen) * size
        order = page.order.value_()
        if page_size is not None and 0 <= order < 32:  # a shift, not a size: the budget bounds the read
            room = min(room, page_size << order)
        count = max(min(page.index.value_(), room // size), 0)
        raw = prog.read(page.records.value_(), count * size)
        ips.update(struct.unpack_from("<Q", raw, i * size + ip_off)[0] for i in range(count))
        seen += max(count, 1)
        page = page.next
    return frozenset(ips)


def within_notrace_func(symbols: Symbols, locations: Sequence[int], addr: int) -> bool:
    """trace_kprobe.c's ``within_notrace_func``: is ``addr`` in a function ftrace cannot trace?

    With dynamic ftrace and without CONFIG_KPROBE_EVENTS_ON_NOTRACE (a debug option
    distributions leave off) the kernel refuses a kprobe event anywhere in such a
    function; a ``func.isra.0``-style copy is judged by ``func``.
    """
    mod = symbols.module_of(addr)
    if mod is not None:
        locations = mod.ftrace_sites  # a module's own __mcount_loc, in its struct module
    if not locations:
        return False

    def notrace(a: int) -> bool:
        sym = symbols.containing(a)
        if sym is None:
            return False
        start, end = sym.addr, sym.addr + symbols.kallsyms_size(sym) - 1
        i = bisect.bisect_left(locations, start)
        return not (i < len(locations) and locations[i] <= end)

    if not notrace(addr):
        return False
    sym = symbols.containing(addr)
    if sym is not None and "." in sym.name:
        base = sym.name.split(".", 1)[0]
        return base not in symbols or notrace(symbols.address(base))
    return True
