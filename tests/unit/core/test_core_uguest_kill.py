"""A qprobe killed at any point of an in-guest uprobe's registration or unregistration (qprobe.core.uguest),
and the next attach's finish_left: the kernel must end with no consumer of qprobe's registered, every
unregister matching one register (6.12: synced), and every inode igrab() held let go exactly once.

GuestUprobes runs for real over one flat memory; its guest calls go through a model of the guest-call
block (the call written, queued by the stub, made and done by the kworker) and a model of the kernel's
uprobe API, which records every misuse.  The kill is an exception after the n-th write to guest memory
or to the journal, for every n until a run completes; the recovery is killed the same way, and the one
after it must still finish the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from qprobe.arch.guestcall import BLOCK_ARGS, BLOCK_DONE, BLOCK_FN, BLOCK_QUEUE, BLOCK_QUEUED, BLOCK_RET, MAX_ARGS
from qprobe.arch.x86_64.guestcall import X86GuestCall
from qprobe.core import uguest
from qprobe.core.guestcall import LastCall, call_data
from qprobe.core.uguest import C_SIZE, GuestUprobes, UprobeApi, finish_left
from qprobe.errors import InvalidProbe, QprobeError, ScratchFull
from qprobe.vmm.journal import Patch

SCRATCH, GC_BLOCK, CONSUMERS = 0xFFFF_FFFF_A000_0000, 0xFFFF_FFFF_A000_0100, 0xFFFF_FFFF_A000_1000
HANDLER_OFF = 24  # struct uprobe_consumer's handler
INODES = (0xFFFF_8880_03A1_B2C0, 0xFFFF_8880_03A1_C000)
MASK = (1 << 64) - 1
EINVAL = (-22) & MASK
SYMBOLS = {name: 0xFFFF_FFFF_8100_0000 + 0x100 * i
           for i, name in enumerate(("irq_exit_rcu", "igrab", "iput", "uprobe_register", "uprobe_unregister",
                                     "uprobe_unregister_nosync", "uprobe_unregister_sync"))}  # fmt: skip
NAMES = {addr: name for name, addr in SYMBOLS.items()}
ARCH: Any = SimpleNamespace(name="x86_64", guest_call=X86GuestCall())


class Killed(BaseException):
    """qprobe killed (nothing of it catches this)."""


class Symbols(dict[str, int]):
    def address(self, name: str) -> int:
        return self[name]


@dataclass
class Kernel:
    """The guest kernel's igrab/iput and uprobe API, as far as qprobe's consumers go."""

    api: UprobeApi
    refuse: bool = False  # uprobe_register fails
    freeing: bool = False  # igrab returns NULL
    refs: dict[int, int] = field(default_factory=dict)  # the references qprobe holds, per inode
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # consumer -> (inode, offset)
    unsynced: set[int] = field(default_factory=set)  # 6.12: unregistered consumers whose handler may still run
    errors: list[str] = field(default_factory=list)

    def run(self, name: str, args: tuple[int, ...]) -> int:
        if name == "igrab":
            if self.freeing:
                return 0
            self.refs[args[0]] = self.refs.get(args[0], 0) + 1
            return args[0]
        if name == "iput":
            if self.refs.get(args[0], 0) <= 0:
                self.errors.append(f"iput({args[0]:#x}) of an inode not held")
            self.refs[args[0]] = self.refs.get(args[0], 0) - 1
            return 0
        if name == "uprobe_register":
            inode, offset, uc = (args[0], args[1], args[3]) if self.api.returns_handle else args[:3]
            if self.refs.get(inode, 0) <= 0:
                self.errors.append("uprobe_register of an inode not held")
            if uc in self.registered:
                self.errors.append(f"consumer {uc:#x} registered twice")
            if self.refuse:
                return EINVAL if self.api.returns_handle else 0x1234_5678_0000_0000 | (EINVAL & 0xFFFF_FFFF)
            self.registered[uc] = (inode, offset)
            return self.handle(uc) if self.api.returns_handle else 0xDEAD_0000_0000_0000  # 6.1: eax 0
        if name == "uprobe_unregister" and not self.api.returns_handle:
            self._unregister(args[2], args[:2])
            return 0
        if name == "uprobe_unregister_nosync" and self.api.returns_handle:
            if args[0] != self.handle(args[1]):
                self.errors.append(f"uprobe_unregister_nosync with {args[0]:#x}, not the consumer's uprobe")
            self._unregister(args[1], None)
            self.unsynced.add(args[1])
            return 0
        if name == "uprobe_unregister_sync" and self.api.returns_handle:
            self.unsynced.clear()
            return 0
        self.errors.append(f"{name}{args} is not this kernel's API")
        return 0

    @staticmethod
    def handle(uc: int) -> int:
        return 0xFFFF_8880_0400_0000 + (uc & 0xFFFF)

    def _unregister(self, uc: int, where: tuple[int, ...] | None) -> None:
        if uc not in self.registered:
            self.errors.append(f"unregister of consumer {uc:#x}, not registered (WARN)")
        elif where is not None and self.registered[uc] != where:
            self.errors.append(f"uprobe_unregister of {uc:#x} at {where}, registered at {self.registered[uc]}")
        self.registered.pop(uc, None)

    def clean(self) -> list[str]:
        """What qprobe left in the kernel, and its misuses."""
        left = [f"consumer {uc:#x} still registered" for uc in self.registered]
        left += [f"consumer {uc:#x} unregistered, never synced" for uc in self.unsynced]
        left += [f"inode {i:#x}: {n} reference(s) left" for i, n in self.refs.items() if n]
        return self.errors + left


class World:
    """Guest memory (virtual = physical), the journal, the guest-call block and the kernel, with the kill."""

    def __init__(self, api: UprobeApi) -> None:
        self.kernel = Kernel(api)
        self.mem = bytearray(0x4000)
        self.journal: list[Patch] = [Patch(0, GC_BLOCK + BLOCK_QUEUE, b"", b"", "guestcall")]
        self.free: list[int] = []
        self.next = CONSUMERS
        self.kill_at = 0  # the write after which qprobe dies (0: never)
        self.writes = 0

    def tick(self) -> None:
        self.writes += 1
        if self.writes == self.kill_at:
            raise Killed

    def write(self, addr: int, data: bytes) -> None:
        self.mem[addr - SCRATCH : addr - SCRATCH + len(data)] = data
        self.tick()

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.mem[addr - SCRATCH : addr - SCRATCH + size])

    def word(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    # The guest-call block: what GuestCaller.call and BareCalls write, and the stub and kworker do.
    def call(self, name: str, *args: int, tag: int = 0) -> int:
        self.write(GC_BLOCK + BLOCK_FN, call_data(SYMBOLS[name], args, tag))
        self.write(GC_BLOCK + BLOCK_QUEUED, (1).to_bytes(8, "little"))
        return self.complete()

    def complete(self) -> int:
        """The kworker makes the call queued in the block."""
        name = NAMES[self.word(GC_BLOCK + BLOCK_FN)]
        args = tuple(self.word(GC_BLOCK + BLOCK_ARGS + 8 * i) for i in range(MAX_ARGS))
        ret = self.kernel.run(name, args)
        self.mem[GC_BLOCK + BLOCK_RET - SCRATCH : GC_BLOCK + BLOCK_DONE + 8 - SCRATCH] = ret.to_bytes(8, "little") + (
            1
        ).to_bytes(8, "little")
        self.tick()
        return ret

    def last(self) -> LastCall:
        return LastCall.parse(self.read(GC_BLOCK + BLOCK_FN, BLOCK_QUEUE - BLOCK_FN))

    # What GuestUprobes takes.
    def alloc(self, size: int, align: int) -> int:
        if self.free:
            return self.free.pop()  # a freed block's address comes back, its words as they were
        self.next += C_SIZE
        return self.next - C_SIZE

    def patch(self, virt: int, new: bytes, what: str) -> Patch:
        p = Patch(virt, virt, self.read(virt, len(new)), new, what)
        self.journal.append(p)
        self.write(virt, new)
        return p

    def unpatch(self, p: Patch) -> None:
        self.journal.remove(p)
        self.write(p.virt, p.old)


class Bare:
    """BareCalls over the world (recovery's guest calls)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def read(self, addr: int, size: int) -> bytes:
        return self.world.read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        self.world.write(addr, data)

    def last(self) -> LastCall:
        return self.world.last()

    def wait_done(self) -> int:
        return self.world.complete()

    def __call__(self, name: str, *args: int, tag: int = 0) -> int:
        return self.world.call(name, *args, tag=tag)


@dataclass(eq=False)
class Up:
    name: str
    nhit: int = 0
    nreturns: int = 0
    ret_handler: None = None
    guest_key: None = None
    recorder: None = None
    nlost: int = 0
    guest_counts: Callable[[], tuple[int, int]] | None = None

    def where(self) -> str:
        return self.name


def fake_kernel(api: UprobeApi) -> Any:
    symbols = Symbols(SYMBOLS)
    for name in (
        ("uprobe_unregister",) if api.returns_handle else ("uprobe_unregister_nosync", "uprobe_unregister_sync")
    ):
        del symbols[name]
    return SimpleNamespace(symbols=symbols, type_offset=lambda t, m: HANDLER_OFF,
                           prog=SimpleNamespace(type=lambda t: SimpleNamespace(size=32)))  # fmt: skip


def uprobes(world: World) -> GuestUprobes:
    machine: Any = SimpleNamespace(call=lambda fn: fn(), patch=world.patch, unpatch=world.unpatch)
    scratch: Any = SimpleNamespace(ensure_mapped=lambda: None, alloc=world.alloc, write=world.write,
                                   phys_of=lambda a: a, free=world.free.append)  # fmt: skip
    ram: Any = SimpleNamespace(write_phys=world.write, read_u64_phys=world.word)
    gu = GuestUprobes(machine, fake_kernel(world.kernel.api), scratch, ARCH, ram)
    gu.caller = SimpleNamespace(call=world.call, release=lambda: None, unavailable=None)  # type: ignore[assignment]
    assert gu.unavailable is None
    return gu


FILES = [SimpleNamespace(inode=i, path=f"/bin/p{n}") for n, i in enumerate(INODES)]
Scenario = Callable[[GuestUprobes, World], None]


def one_in_and_out(gu: GuestUprobes, world: World) -> None:
    up = Up("a")
    gu.register(up, FILES[0], 0x1139)  # type: ignore[arg-type]
    gu.unregister(up)  # type: ignore[arg-type]


def two_in_first_out(gu: GuestUprobes, world: World) -> None:
    a, b = Up("a"), Up("b")
    gu.register(a, FILES[0], 0x1139)  # type: ignore[arg-type]
    gu.register(b, FILES[1], 0x2000)  # type: ignore[arg-type]
    gu.unregister(a)  # type: ignore[arg-type]  # the block's last call was b's


def again_at_the_same_block(gu: GuestUprobes, world: World) -> None:
    for _ in range(2):
        one_in_and_out(gu, world)


def refused(gu: GuestUprobes, world: World) -> None:
    world.kernel.refuse = True
    with pytest.raises(InvalidProbe, match="refused"):
        gu.register(Up("a"), FILES[0], 0x1139)  # type: ignore[arg-type]


def inode_going(gu: GuestUprobes, world: World) -> None:
    world.kernel.freeing = True
    with pytest.raises(InvalidProbe, match="igrab"):
        gu.register(Up("a"), FILES[0], 0x1139)  # type: ignore[arg-type]


SCENARIOS = [one_in_and_out, two_in_first_out, again_at_the_same_block, refused, inode_going]
APIS = [UprobeApi(returns_handle=False), UprobeApi(returns_handle=True)]


def recover(world: World, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(uguest, "BareCalls", lambda *a: Bare(world))
    return finish_left(SimpleNamespace(), fake_kernel(world.kernel.api), ARCH, list(world.journal))  # type: ignore[arg-type]


def killed_at(api: UprobeApi, scenario: Scenario, kill_at: int) -> World | None:
    """The world ``scenario`` leaves when killed after its ``kill_at``-th write (None: it finished first)."""
    world = World(api)
    world.kill_at = kill_at
    try:
        scenario(uprobes(world), world)
    except Killed:
        return world
    return None


@pytest.mark.parametrize("api", APIS, ids=["6.1", "6.12"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_qprobe_killed_anywhere_is_finished_by_the_next_attach(
    api: UprobeApi, scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    kills = 0
    while (world := killed_at(api, scenario, kills + 1)) is not None:
        kills += 1
        world.kill_at = 0
        recover(world, monkeypatch)
        assert world.kernel.clean() == [], f"killed after write {kills}"
    assert kills > 5
    world = World(api)
    scenario(uprobes(world), world)  # not killed: what it leaves armed is taken out too
    recover(world, monkeypatch)
    assert world.kernel.clean() == []


@pytest.mark.parametrize("api", APIS, ids=["6.1", "6.12"])
@pytest.mark.parametrize("scenario", [one_in_and_out, two_in_first_out])
def test_a_recovery_killed_anywhere_is_finished_by_the_next(
    api: UprobeApi, scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    kills = 1
    while killed_at(api, scenario, kills) is not None:
        steps = 1
        while True:
            world = killed_at(api, scenario, kills)
            assert world is not None
            world.writes, world.kill_at = 0, steps
            try:
                recover(world, monkeypatch)
            except Killed:
                world.kill_at = 0
                recover(world, monkeypatch)
                assert world.kernel.clean() == [], f"killed after write {kills}, its recovery after {steps}"
                steps += 1
                continue
            assert world.kernel.clean() == [], f"killed after write {kills}"
            break
        kills += 1


class Ids:
    """The optimizer's probe ids of recorders (``open_recorder``), full when told."""

    def __init__(self, full: bool) -> None:
        self.full = full
        self.open: set[int] = set()
        self.records = SimpleNamespace(handler_code=lambda probe_id, counter, returns, at: b"\x90" * 64)

    def open_recorder(self, owner: object, deliver: object) -> int:
        if self.full:
            raise QprobeError("every one of the 255 probe ids of detours and recorders is in use")
        self.open.add(len(self.open) + 1)
        return len(self.open)


@pytest.mark.parametrize("short", ["probe ids", "scratch"])
def test_a_recorder_that_cannot_be_had_leaves_no_id_and_no_scratch_behind(short: str) -> None:
    world = World(APIS[0])
    gu = uprobes(world)
    gu.optimizer = ids = Ids(full=short == "probe ids")  # type: ignore[assignment]
    taken: list[int] = []
    alloc = world.alloc

    def scratch_alloc(size: int, align: int) -> int:
        if short == "scratch" and taken:  # the consumer's block fits; the handler's code does not
            raise ScratchFull("the scratch area is full")
        taken.append(alloc(size, align))
        return taken[-1]

    gu.scratch.alloc = scratch_alloc
    up = Up("a")
    up.recorder = lambda records: None  # type: ignore[assignment]
    with pytest.raises(QprobeError):
        gu.register(up, FILES[0], 0x1139)  # type: ignore[arg-type]
    assert sorted(world.free) == sorted(taken) and not ids.open and not world.kernel.clean()
