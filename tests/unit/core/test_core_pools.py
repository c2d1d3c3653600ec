"""Kretprobe instance pools in guest RAM (qprobe.core.pools) on the toy architecture.

The guest's side (an entry detour taking an instance, a return freeing it)
is played by writing the toy's instance layout into RAM: u64 stack slot
(0: free), return address, task, owner.
"""

from __future__ import annotations

import struct

import pytest
from fakearch import SCRATCH, STACK, Toy, ToyTarget

from qprobe.core.kprobe import Kretprobe
from qprobe.core.pools import MAX_INSTANCES, MAX_OWNERS, ReturnPools

CALLER = 0xFFFF_8000_0000_9000


class Guest:
    def __init__(self) -> None:
        self.t = ToyTarget()
        self.t.scratch.map()
        self.pools = ReturnPools(Toy(), self.t.machine, self.t.scratch, self.t.mem,  # type: ignore[arg-type]
                                 lambda: 0x40, lambda: SCRATCH)  # fmt: skip

    def instance(self, i: int) -> tuple[int, int, int, int]:
        assert self.pools.ret is not None
        raw = self.t.mem.read(self.pools.ret.instance(i), 32)
        return struct.unpack("<4Q", raw)

    def take(self, i: int, slot: int, ret: int, task: int) -> None:
        """The guest's entry detour takes instance ``i``: the trampoline's address goes in the stack slot."""
        assert self.pools.ret is not None
        owner = self.instance(i)[3]
        self.t.mem.write(self.pools.ret.instance(i), struct.pack("<4Q", slot, ret, task, owner))
        self.t.mem.write(slot, self.pools.ret.trampoline(i).to_bytes(8, "little"))

    def count_return(self, owner: int, n: int) -> None:
        """The guest counts ``n`` returns of ``owner`` (a pool without a handler)."""
        assert self.pools.ret is not None
        at = self.pools.ret.returns + 8 * owner
        self.t.mem.write(at, (self.t.mem.read_u64(at) + n).to_bytes(8, "little"))


@pytest.fixture
def guest() -> Guest:
    return Guest()


def test_pools_are_disjoint_first_fit_slices_with_their_instances_free(guest: Guest) -> None:
    rps = [Kretprobe("f", handler=lambda ri, regs: None), Kretprobe("g"), Kretprobe("h")]
    got = [guest.pools.alloc(rp, n) for rp, n in zip(rps, (4, 10, 2), strict=True)]
    assert [(p.first, p.count, p.owner) for p in got if p] == [(0, 4, 1), (4, 10, 2), (14, 2, 3)]
    # Free instances carry their owner (and whether a return goes to the host's handler).
    assert guest.instance(0) == (0, 0, 0, 1 | 1 << 32)
    assert guest.instance(13) == (0, 0, 0, 2)
    assert guest.pools.instances(got[1]) == []  # none taken  # type: ignore[arg-type]
    assert guest.t.machine.journal.meta["ninstances"] == MAX_INSTANCES


def test_allocation_is_bounded_by_the_array_and_by_the_owners(guest: Guest) -> None:
    assert guest.pools.alloc(Kretprobe("f"), MAX_INSTANCES + 1) is None
    assert guest.pools.alloc(Kretprobe("f"), MAX_INSTANCES - 1) is not None
    assert guest.pools.alloc(Kretprobe("g"), 2) is None  # one instance left
    last = guest.pools.alloc(Kretprobe("g"), 1)
    assert last is not None and last.first == MAX_INSTANCES - 1

    fresh = Guest()
    owners = [fresh.pools.alloc(Kretprobe("f"), 1) for _ in range(MAX_OWNERS)]
    assert [p.owner for p in owners[:-1] if p] == list(range(1, MAX_OWNERS))  # owner 0 is nobody's
    assert owners[-1] is None  # one return counter per owner: no more pools


def test_retiring_puts_return_addresses_back_and_the_slice_is_reused_once_drained(guest: Guest) -> None:
    rp, rp2 = Kretprobe("f"), Kretprobe("g")
    pool = guest.pools.alloc(rp, 4)
    assert pool is not None and guest.pools.alloc(rp2, 4) is not None
    slot = STACK + 0x800
    guest.take(1, slot, CALLER, task=0x1234)
    assert guest.pools.find(slot) == (rp, 1, CALLER, 0x1234)
    assert guest.pools.return_address(guest.pools.ret.trampoline(1)) == CALLER  # type: ignore[union-attr]
    guest.pools.retire(rp)
    assert guest.t.mem.read_u64(slot) == CALLER  # the call returns to its caller, unprobed
    assert guest.instance(1)[0] == 0  # and its instance is free
    assert guest.pools.alloc(Kretprobe("h"), 4) == type(pool)(0, 4, 1)  # the drained slice and owner, again


def test_a_call_already_returning_keeps_its_instance_until_the_trampoline_frees_it(guest: Guest) -> None:
    rp = Kretprobe("f")
    pool = guest.pools.alloc(rp, 2)
    assert pool is not None
    slot = STACK + 0x800
    guest.take(0, slot, CALLER, task=1)
    guest.t.mem.write(slot, CALLER.to_bytes(8, "little"))  # the ret consumed the slot...
    guest.t.mem.write(slot - 16, guest.pools.ret.trampoline(0).to_bytes(8, "little"))  # type: ignore[union-attr]
    guest.pools.retire(rp)  # ...and an interrupt frame below it holds the trampoline: in flight
    assert guest.pools.find(slot) == (None, 0, CALLER, 1)  # no handler any more: owner gone
    assert guest.pools.alloc(Kretprobe("g"), 2) == type(pool)(2, 2, 2)  # the slice is not reused yet
    guest.pools.free(0)
    assert guest.pools.alloc(Kretprobe("h"), 2) == type(pool)(0, 2, 1)


def test_guest_counted_returns_fold_into_nreturns(guest: Guest) -> None:
    rp = Kretprobe("f")
    pool = guest.pools.alloc(rp, 2)
    assert pool is not None
    guest.count_return(pool.owner, 5)
    guest.pools.fold_all()
    guest.count_return(pool.owner, 2)
    guest.pools.fold_all()
    assert rp.nreturns == 7
    guest.count_return(pool.owner, 1)
    guest.pools.retire(rp)  # folded one last time
    guest.count_return(pool.owner, 3)
    guest.pools.fold_all()
    assert rp.nreturns == 8


def test_a_value_that_is_not_a_trampoline_has_no_return_address(guest: Guest) -> None:
    assert guest.pools.return_address(CALLER) is None  # before any pool exists
    guest.pools.alloc(Kretprobe("f"), 1)
    ret = guest.pools.ret
    assert ret is not None
    assert guest.pools.return_address(ret.trampoline(0) + 4) is None
    assert guest.pools.return_address(ret.trampoline(MAX_INSTANCES)) is None
