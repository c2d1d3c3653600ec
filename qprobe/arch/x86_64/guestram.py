"""x86's :class:`qprobe.arch.GuestRam`: the layouts in guest RAM its stubs and detours fill, read by the host.

The mailbox and record stubs and the rings are detour's, the kretprobe
instances and trampolines retdetour's, the per-CPU keyed tables guestagg's;
this class says where things are in them and parses what the guest wrote.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping

from qprobe.arch.guestram import MailboxRequest, PercpuLayout, ReturnLayout, RingEntry
from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
from qprobe.arch.x86_64 import detour, guestagg, retdetour
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, PT_REGS_SIZE, STUB_FRAME_REGS, parse_stub_frame, stub_frame_offset

_MAILBOX = struct.Struct(f"<{(detour.MB_REGS + detour.FRAME_SIZE) // 8}Q")  # a mailbox up to the end of its frame
_ANSWER = struct.Struct("<2Q")  # MB_FINAL_IP, MB_FINAL_SP: written in one go
assert detour.MB_FINAL_SP == detour.MB_FINAL_IP + 8
# A ring entry as one unpack: the frame's registers of the probed context in memory order, and the ip a
# uprobe handler's entry holds (the words of the rest skipped, so the unpack starts with exactly the registers
# a record's dict holds), the probe id, the TSC, CPU and pid, comm (16 bytes), task and a return's function,
# then padding.
_KEPT = (*STUB_FRAME_REGS, "rip")
_FRAME_KEYS = tuple(g for g in PT_REGS_ORDER if g in _KEPT)
_ENTRY = struct.Struct("<" + "".join("Q" if g in _KEPT else "8x" for g in PT_REGS_ORDER)
                       + f"QQQ16sQQ{detour.ENTRY_SIZE - detour.E_FUNC - 8}x")  # fmt: skip
_E_ID = len(_FRAME_KEYS)  # fields of the unpack
_E_TSC, _E_CPU_PID, _E_COMM, _E_TASK, _E_FUNC = _E_ID + 1, _E_ID + 2, _E_ID + 3, _E_ID + 4, _E_ID + 5
assert sorted(_FRAME_KEYS) == sorted(_KEPT) and _ENTRY.size == detour.ENTRY_SIZE
assert detour.FRAME_ID == PT_REGS_SIZE and detour.E_TSC == detour.FRAME_ID + 8
assert detour.E_CPU_PID == detour.E_TSC + 8 and detour.E_COMM == detour.E_CPU_PID + 8
assert detour.E_TASK == detour.E_COMM + 16 and detour.E_FUNC == detour.E_TASK + 8


class X86GuestRam:
    """The mailbox, the record rings, the keyed tables and the kretprobe instances, as x86's code lays them out."""

    mailbox_size = detour.MAILBOX_SIZE
    drain_doorbell = detour.DRAIN_DOORBELL
    trampoline_id = retdetour.TRAMPOLINE_ID
    ring_header_size = detour.RING_HEADER
    ring_entries = detour.RING_ENTRIES
    ring_entry_size = detour.ENTRY_SIZE
    ring_head, ring_tail = detour.R_HEAD, detour.R_TAIL
    ring_waits, ring_lossy = detour.R_WAITS, detour.R_LOSSY
    instance_size = retdetour.INSTANCE_SIZE

    # -- the mailbox ----------------------------------------------------------------------------
    def build_mailbox_stub(self, mailboxes: int, missed: int, percpu: PercpuLayout, port: int, address: int) -> bytes:
        params = detour.StubParams(mailboxes, missed, percpu.cpu_number, percpu.this_cpu_off, percpu.current_task,
                                   port)  # fmt: skip
        return detour.build_stub(params, address)

    def read_mailbox(self, read: Callable[[int, int], bytes]) -> MailboxRequest | None:
        """The request in a CPU's mailbox (``read(offset, size)`` reads it), or None if there is none.

        The state is read first: the stub writes everything else before it publishes REQUEST.
        """
        if int.from_bytes(read(detour.MB_STATE, 8), "little") != detour.STATE_REQUEST:
            return None
        raw = read(0, _MAILBOX.size)  # the header words and the frame, in one read
        box = _MAILBOX.unpack(raw)
        values, continue_addr, probe_id = parse_stub_frame(raw, detour.MB_REGS)
        frame = box[detour.MB_FRAME // 8]
        values.update(rsp=frame + detour.FRAME_SIZE, cr3=box[detour.MB_CR3 // 8], gs_base=box[detour.MB_PERCPU // 8],
                      cycles=box[detour.MB_TSC // 8])  # fmt: skip
        return MailboxRequest(probe_id, values, continue_addr, frame, frame + detour.FRAME_SIZE)

    def mailbox_answer(self, changed: Mapping[str, int], final_ip: int, final_sp: int) -> list[tuple[int, bytes]]:
        """(offset, bytes) writes that answer a request, in order; the last publishes DONE in one store."""
        writes = []
        for name, value in changed.items():
            off = stub_frame_offset(name)
            if off is not None:
                writes.append((detour.MB_REGS + off, value.to_bytes(8, "little")))
        writes.append((detour.MB_FINAL_IP, _ANSWER.pack(final_ip, final_sp)))
        writes.append((detour.MB_STATE, detour.STATE_DONE.to_bytes(8, "little")))
        return writes

    def return_trampoline(self, address: int, stub: int) -> bytes:
        """The stop-less kretprobe trampoline at ``address``: ``push 0; call stub; int3``."""
        return detour.build_detour(address, retdetour.TRAMPOLINE_ID, stub, b"", 0)[: detour.DETOUR_HEAD] + b"\xcc"

    # -- the record rings -------------------------------------------------------------------------
    def build_record_stub(self, rings: int, ncpus: int, entries: int, lost: int, percpu: PercpuLayout,
                          pid_offset: int, comm_offset: int, port: int, address: int) -> bytes:  # fmt: skip
        params = detour.RecordParams(rings, rings + detour.RING_HEADER * ncpus, entries, lost, percpu.cpu_number,
                                     percpu.current_task, pid_offset, comm_offset, port)  # fmt: skip
        return detour.build_record_stub(params, address)

    def build_record_handler(self, rings: int, ncpus: int, entries: int, lost: int, percpu: PercpuLayout,
                             pid_offset: int, comm_offset: int, port: int, probe_id: int, counter: int,
                             returns: bool, address: int) -> bytes:  # fmt: skip
        params = detour.RecordParams(rings, rings + detour.RING_HEADER * ncpus, entries, lost, percpu.cpu_number,
                                     percpu.current_task, pid_offset, comm_offset, port)  # fmt: skip
        return detour.build_record_handler(params, probe_id, counter, returns, address)

    def parse_ring_entries(self, raw: bytes) -> list[RingEntry]:
        """Consecutive entries in one pass: a drain reads thousands, so each is one unpack and one dict."""
        out = []
        comms: dict[bytes, str] = {}  # a few tasks make most records: each name decoded once
        for words in _ENTRY.iter_unpack(raw):
            values = dict(zip(_FRAME_KEYS, words, strict=False))  # the registers: the unpack's first fields
            raw_comm = words[_E_COMM]
            comm = comms.get(raw_comm)
            if comm is None:
                comm = comms[raw_comm] = detour.task_comm(raw_comm)
            cpu_pid = words[_E_CPU_PID]
            out.append(RingEntry(words[_E_ID], cpu_pid & 0xFFFFFFFF, detour.task_pid(cpu_pid >> 32), comm,
                                 words[_E_TASK], words[_E_TSC], values["rsp"], values, words[_E_FUNC]))  # fmt: skip
        return out

    # -- the keyed tables ---------------------------------------------------------------------------
    def guest_map_size(self, spec: KeySpec) -> int:
        return guestagg.table_size(spec)

    def parse_guest_map(self, spec: KeySpec, raw: bytes) -> dict[MapKey, MapSlot]:
        """Key -> slot over one or more CPUs' tables of a "keyed" detour, each key part decoded."""
        out: dict[MapKey, MapSlot] = {}
        for words, slot in guestagg.parse_tables(spec, raw).items():
            key = guestagg.decode_key(spec, words)
            old = out.get(key)  # two comm words that differ only after the NUL are one name
            out[key] = slot if old is None else old.merge(slot)
        return out

    # -- kretprobe instances and their trampolines ------------------------------------------------------
    def return_layout(self, instances: int, count: int, trampolines: int, returns: int, stub: int,
                      current_task: int) -> ReturnLayout:  # fmt: skip
        return retdetour.RetParams(instances, count, trampolines, returns, stub, current_task)

    def build_return_trampolines(self, layout: ReturnLayout) -> bytes:
        assert isinstance(layout, retdetour.RetParams)
        return retdetour.build_trampolines(layout)

    def return_int3s(self, layout: ReturnLayout) -> tuple[int, int]:
        """The shared return code's two int3s: after the mailbox call (busy mailbox), and on a bad instance."""
        assert isinstance(layout, retdetour.RetParams)
        common = layout.trampoline(layout.count)
        busy, bad = retdetour.common_offsets(layout)
        return common + busy, common + bad

    def new_instance(self, owner: int, mailbox: bool) -> bytes:
        """A free instance of ``owner``'s pool, whose return counts in the guest or goes to the mailbox."""
        raw = bytearray(retdetour.INSTANCE_SIZE)
        mode = retdetour.MODE_MAILBOX if mailbox else retdetour.MODE_COUNT
        struct.pack_into("<II", raw, retdetour.I_OWNER, owner, mode)
        return bytes(raw)

    def parse_instances(self, raw: bytes) -> list[tuple[int, int, int, int]]:
        """(n, slot, return address, task) of every taken instance in ``raw`` (consecutive instances)."""
        out = []
        for n in range(len(raw) // retdetour.INSTANCE_SIZE):
            slot, ret, task = struct.unpack_from("<3Q", raw, n * retdetour.INSTANCE_SIZE + retdetour.I_SLOT)
            if slot:
                out.append((n, slot, ret, task))
        return out

    def instance_return_field(self, layout: ReturnLayout, i: int) -> int:
        return layout.instance(i) + retdetour.I_RET

    def trampoline_index(self, layout: ReturnLayout, value: int) -> int | None:
        """If ``value`` is instance i's trampoline, i."""
        if not layout.trampolines <= value < layout.trampoline(layout.count):
            return None
        return (value - layout.trampolines) // retdetour.TRAMP_STRIDE


__all__ = ["X86GuestRam"]
