"""Kretprobe instances in guest RAM: one array, sliced into a pool per return probe.

A jump-optimized kretprobe's entry detour takes a free instance from its
probe's pool, saves the return address there and puts the address of the
instance's own trampoline on the stack; the trampoline counts the return in
the guest or hands it to the host through the mailbox.  The host allocates
the pools, reads the instances (for the unwinder and for the returns it
answers), folds the guest's return counters, and puts every real return
address back when a probe goes.  The layouts are the architecture's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from qprobe.arch import Arch, ReturnLayout
from qprobe.arch.guestram import Pool
from qprobe.core.kprobe import Kretprobe
from qprobe.errors import QprobeError
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import SharedRam
from qprobe.vmm.scratch import ScratchArea

MAX_INSTANCES = 2048  # kretprobe instances in guest RAM, shared by every return probe's pool
MAX_OWNERS = 256  # return probes with a pool at once: one return counter each


@dataclass
class PoolState:
    """A return probe's instances in guest RAM; ``rp`` is None once it is unregistered and the pool drains."""

    pool: Pool
    rp: Kretprobe | None


def page_round(n: int) -> int:
    return (n + 0xFFF) & ~0xFFF


class ReturnPools:
    """The instance array and its pools (stop loop, but for the reads the doorbell thread makes)."""

    def __init__(self, arch: Arch, machine: Machine, scratch: ScratchArea, ram: SharedRam,
                 current_task: Callable[[], int], stub: Callable[[], int]) -> None:  # fmt: skip
        assert arch.guest_ram is not None  # built only for an architecture with guest-RAM layouts
        self.arch = arch
        self.layouts = arch.guest_ram
        self.machine = machine
        self.scratch = scratch
        self.ram = ram
        self.current_task = current_task  # the per-CPU offset of current_task
        self.stub = stub  # the mailbox stub's address, built on first use
        self.ret: ReturnLayout | None = None  # where the instances are, once a return probe wants them
        self.pools: dict[int, PoolState] = {}  # owner -> pool
        self._returns_seen: dict[int, int] = {}

    def ensure(self) -> ReturnLayout:
        """The instance array, its return counters and the per-instance trampolines, on first use."""
        if self.ret is not None and self.scratch.mapped:
            return self.ret
        stub = self.stub()
        scratch, layouts = self.scratch, self.layouts
        size = MAX_INSTANCES * layouts.instance_size + MAX_OWNERS * 8
        data = scratch.alloc(page_round(size), align=4096)  # written by the guest: apart from code
        self.ram.write_phys(scratch.phys_of(data), bytes(size))
        returns, current = data + MAX_INSTANCES * layouts.instance_size, self.current_task()
        probe = layouts.return_layout(data, MAX_INSTANCES, scratch.base, returns, stub, current)
        code = scratch.alloc(len(layouts.build_return_trampolines(probe)), align=64)
        self.ret = layouts.return_layout(data, MAX_INSTANCES, code, returns, stub, current)
        self.machine.journal.set_meta(instances=data, ninstances=MAX_INSTANCES, ret_trampolines=code)
        scratch.write(code, layouts.build_return_trampolines(self.ret))
        self.pools.clear()
        return self.ret

    def int3s(self) -> tuple[int, int]:
        """The shared return code's two int3s: after the mailbox call (busy mailbox), and on a bad instance."""
        assert self.ret is not None
        return self.layouts.return_int3s(self.ret)

    def alloc(self, rp: Kretprobe, count: int) -> Pool | None:
        """A slice of ``count`` free instances for ``rp`` (None if the array has no room: the host keeps them)."""
        ret = self.ensure()
        self._release_drained()
        owner = next((o for o in range(1, MAX_OWNERS) if o not in self.pools), None)
        used = sorted((s.pool.first, s.pool.first + s.pool.count) for s in self.pools.values())
        first, start = None, 0
        for lo, hi in [*used, (ret.count, ret.count)]:
            if lo - start >= count:
                first = start
                break
            start = max(start, hi)
        if owner is None or first is None or count > ret.count:
            return None
        pool = Pool(first, count, owner)
        free = self.layouts.new_instance(owner, mailbox=rp.handler is not None)
        for i in range(first, first + count):
            self.ram.write_phys(self.scratch.phys_of(ret.instance(i)), free)
        self.pools[owner] = PoolState(pool, rp)
        self._returns_seen[owner] = self._returns(owner)
        return pool

    def instances(self, pool: Pool) -> list[tuple[int, int, int, int]]:
        """(index, slot, return address, task) of every taken instance of ``pool``, read from guest RAM."""
        assert self.ret is not None
        raw = self.ram.read_phys(self.scratch.phys_of(self.ret.instance(pool.first)),
                                 pool.count * self.layouts.instance_size)  # fmt: skip
        return [(pool.first + n, slot, ret, task) for n, slot, ret, task in self.layouts.parse_instances(raw)]

    def find(self, slot: int) -> tuple[Kretprobe | None, int, int, int] | None:
        """The taken instance for a return through stack ``slot``: (its probe, index, return address, task)."""
        for state in list(self.pools.values()):
            for i, s, ret, task in self.instances(state.pool):
                if s == slot:
                    return state.rp, i, ret, task
        return None

    def free(self, i: int) -> None:
        assert self.ret is not None
        self.ram.write_u64_phys(self.scratch.phys_of(self.ret.instance(i)), 0)

    def return_address(self, value: int) -> int | None:
        """If ``value`` is an instance's trampoline, the real return address it stands for."""
        ret = self.ret
        i = None if ret is None else self.layouts.trampoline_index(ret, value)
        if i is None:
            return None
        assert ret is not None
        return self.ram.read_u64_phys(self.scratch.phys_of(self.layouts.instance_return_field(ret, i)))

    def retire(self, rp: Kretprobe) -> None:
        """Put back the real return address of every call of ``rp`` still in flight (stop loop, VM stopped).

        A call that has already returned into its trampoline (a vCPU inside the
        shared return code, or a context interrupted on the trampoline's first
        instruction, whose interrupt frame sits just below the slot) keeps its
        instance: the trampoline frees it.  The pool is reused once every
        instance is free.
        """
        owner = next((o for o, s in self.pools.items() if s.rp is rp), None)
        if owner is None or self.ret is None:
            return
        state = self.pools[owner]
        self._fold(owner, state)
        state.rp = None
        ret, mem, gdb = self.ret, self.machine.mem, self.machine.gdb
        # A vCPU in the scratch area may be returning through one of these (in the shared code or the stub).
        inside = any(self.scratch.contains(self.arch.ip(gdb.read_registers(t))) for t in self.machine.vcpus)
        for i, slot, real, _task in self.instances(state.pool):
            tramp = ret.trampoline(i)
            try:
                if mem.read_u64(slot) == tramp:
                    self.machine.write_phys(mem.virt_to_phys(slot), real.to_bytes(8, "little"))
                    self.free(i)
                    continue
                near = mem.read(slot - 56, 64)
            except QprobeError:
                near = b""  # the stack is gone: nothing can return through it
            if inside or tramp in struct.unpack(f"<{len(near) // 8}Q", near):
                continue
            self.free(i)  # a call that never returned (its task exited inside the function)

    def fold_all(self) -> None:
        """Every pool's returns counted in the guest since the last fold, into its probe's nreturns."""
        if self.ret is not None:
            for owner, state in list(self.pools.items()):
                self._fold(owner, state)

    def _release_drained(self) -> None:
        for owner, state in list(self.pools.items()):
            if state.rp is None and not self.instances(state.pool):
                del self.pools[owner]

    def _returns(self, owner: int) -> int:
        assert self.ret is not None
        return self.ram.read_u64_phys(self.scratch.phys_of(self.ret.returns + owner * 8))

    def _fold(self, owner: int, state: PoolState) -> None:
        """Returns counted in the guest (count-mode pools) into the probe's nreturns."""
        now = self._returns(owner)
        delta = now - self._returns_seen.get(owner, now)
        self._returns_seen[owner] = now
        if state.rp is not None:
            state.rp.nreturns += delta


__all__ = ["MAX_INSTANCES", "MAX_OWNERS", "PoolState", "ReturnPools"]
