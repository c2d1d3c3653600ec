"""Uprobes counted in the guest (qprobe.core.uguest): the take-out state machine, uprobe_register()'s errors
and the words a killed qprobe leaves in its blocks, for Linux 6.1's API and 6.12's."""

from __future__ import annotations

import errno

import pytest

from qprobe.arch.guestcall import BLOCK_FN, BLOCK_QUEUE, MAX_ARGS
from qprobe.core.guestcall import LastCall, call_data
from qprobe.core.uguest import (
    C_HANDLE,
    C_INODE,
    C_OFFSET,
    C_SIZE,
    C_STATE,
    S_ARMED,
    S_IGRAB,
    S_IPUT,
    S_NEW,
    S_REGISTER,
    S_SYNC,
    S_UNREGISTER,
    Registration,
    UprobeApi,
    left_call,
    register_error,
    take_out,
)
from qprobe.errors import TargetError

V61, V612 = UprobeApi(returns_handle=False), UprobeApi(returns_handle=True)
BLOCK = 0xFFFF_FFFF_A000_1040  # the consumer (its block starts with it)
INODE = 0xFFFF_8880_03A1_B2C0
OFFSET = 0x1139
HANDLE = 0xFFFF_8880_04C0_FF00  # 6.12's struct uprobe *
MASK = (1 << 64) - 1
EINVAL = (-errno.EINVAL) & MASK
GARBAGE = 0xDEAD_BEEF_0000_0000  # what an int-returning function may leave in rax's upper half

Calls = list[tuple[str, tuple[int, ...]]]


def run(api: UprobeApi, state: int, done: bool, ret: int, inode: int = INODE,
        handle: int = HANDLE) -> tuple[Calls, list[int]]:  # fmt: skip
    """take_out from ``state``: the guest calls it made and the steps it recorded, in order."""
    calls: Calls = []
    steps: list[int] = []

    def call(name: str, *args: int) -> int:
        calls.append((name, args))
        return 0

    reg = Registration(BLOCK, None, inode, OFFSET, handle if api.returns_handle else 1, state)
    take_out(call, api, reg, done, ret, steps.append)
    return calls, steps


IPUT = ("iput", (INODE,))
UNREG61 = ("uprobe_unregister", (INODE, OFFSET, BLOCK))
NOSYNC, SYNC = ("uprobe_unregister_nosync", (HANDLE, BLOCK)), ("uprobe_unregister_sync", ())


@pytest.mark.parametrize(
    ("api", "state", "done", "ret", "inode", "calls", "steps"),
    [
        # Nothing was called yet: nothing to undo.
        (V61, S_NEW, True, 0, 0, [], []),
        (V612, S_NEW, True, 0, 0, [], []),
        # igrab returned: the inode is held even though the host never wrote it into the block.
        (V61, S_IGRAB, True, INODE, 0, [IPUT], [S_IPUT]),
        (V612, S_IGRAB, True, INODE, 0, [IPUT], [S_IPUT]),
        (V61, S_IGRAB, True, 0, 0, [], []),  # igrab found the inode being freed
        (V61, S_IGRAB, False, 0, 0, [], []),  # never made
        (V612, S_IGRAB, False, 0, 0, [], []),
        # uprobe_register returned success: the consumer is registered (6.1: only eax is the int).
        (V61, S_REGISTER, True, 0, INODE, [UNREG61, IPUT], [S_UNREGISTER, S_IPUT]),
        (V61, S_REGISTER, True, GARBAGE, INODE, [UNREG61, IPUT], [S_UNREGISTER, S_IPUT]),
        (V612, S_REGISTER, True, HANDLE, INODE, [NOSYNC, SYNC, IPUT], [S_UNREGISTER, S_SYNC, S_IPUT]),
        # ...or failed: never unregister what is not registered (the kernel WARNs).
        (V61, S_REGISTER, True, EINVAL, INODE, [IPUT], [S_IPUT]),
        (V61, S_REGISTER, True, GARBAGE | (EINVAL & 0xFFFF_FFFF), INODE, [IPUT], [S_IPUT]),
        (V612, S_REGISTER, True, EINVAL, INODE, [IPUT], [S_IPUT]),
        # ...or was never made.
        (V61, S_REGISTER, False, 0, INODE, [IPUT], [S_IPUT]),
        (V612, S_REGISTER, False, 0, INODE, [IPUT], [S_IPUT]),
        (V612, S_REGISTER, False, HANDLE, INODE, [IPUT], [S_IPUT]),
        # Armed: the handle and inode are the block's.
        (V61, S_ARMED, True, 0, INODE, [UNREG61, IPUT], [S_UNREGISTER, S_IPUT]),
        (V612, S_ARMED, True, 0, INODE, [NOSYNC, SYNC, IPUT], [S_UNREGISTER, S_SYNC, S_IPUT]),
        # Unregistered (6.12: the sync still owed); an unregister never made is the armed state's.
        (V61, S_UNREGISTER, True, 0, INODE, [IPUT], [S_IPUT]),
        (V612, S_UNREGISTER, True, 0, INODE, [SYNC, IPUT], [S_SYNC, S_IPUT]),
        (V61, S_UNREGISTER, False, 0, INODE, [UNREG61, IPUT], [S_UNREGISTER, S_IPUT]),
        (V612, S_UNREGISTER, False, 0, INODE, [NOSYNC, SYNC, IPUT], [S_UNREGISTER, S_SYNC, S_IPUT]),
        # Synced: only the inode left; a sync never made is made.
        (V612, S_SYNC, True, 0, INODE, [IPUT], [S_IPUT]),
        (V612, S_SYNC, False, 0, INODE, [SYNC, IPUT], [S_SYNC, S_IPUT]),
        # Let go: nothing left; an iput never made is made (6.1 has no sync: its iput follows the unregister).
        (V61, S_IPUT, True, 0, INODE, [], []),
        (V612, S_IPUT, True, 0, INODE, [], []),
        (V61, S_IPUT, False, 0, INODE, [IPUT], [S_IPUT]),
        (V612, S_IPUT, False, 0, INODE, [IPUT], [S_IPUT]),
    ],
)
def test_take_out_finishes_a_registration_from_its_state(
    api: UprobeApi, state: int, done: bool, ret: int, inode: int, calls: Calls, steps: list[int]
) -> None:
    assert run(api, state, done, ret, inode) == (calls, steps)


@pytest.mark.parametrize("api", [V61, V612])
def test_a_step_is_recorded_before_its_call(api: UprobeApi) -> None:
    events: list[object] = []

    def call(name: str, *args: int) -> int:
        events.append(name)
        return 0

    take_out(call, api, Registration(BLOCK, None, INODE, OFFSET, HANDLE, S_ARMED), True, 0, events.append)
    want = ([S_UNREGISTER, "uprobe_unregister_nosync", S_SYNC, "uprobe_unregister_sync", S_IPUT, "iput"]
            if api.returns_handle else [S_UNREGISTER, "uprobe_unregister", S_IPUT, "iput"])  # fmt: skip
    assert events == want


@pytest.mark.parametrize(
    ("ret", "error"),
    [
        (0, 0),
        (GARBAGE, 0),  # eax 0: success, whatever the upper half
        (EINVAL, -errno.EINVAL),
        (EINVAL & 0xFFFF_FFFF, -errno.EINVAL),  # a 32-bit write zero-extends: rax = 0x00000000ffffffea
        (GARBAGE | ((-errno.EBUSY) & 0xFFFF_FFFF), -errno.EBUSY),
        (0x7FFF_FFFF, 0x7FFF_FFFF),  # not 0 is not success, even positive
    ],
)
def test_linux_61_register_returns_an_int_in_eax(ret: int, error: int) -> None:
    assert register_error(V61, ret) == error


@pytest.mark.parametrize(
    ("ret", "error"),
    [
        (HANDLE, 0),
        (0xFFFF_FFFF_8100_0000, 0),  # any kernel address is a uprobe
        (EINVAL, -errno.EINVAL),
        ((-errno.ENOMEM) & MASK, -errno.ENOMEM),
        ((-4095) & MASK, -4095),  # MAX_ERRNO: the last ERR_PTR
        ((-4096) & MASK, 0),  # one below it is an address
        (EINVAL & 0xFFFF_FFFF, 0),  # a pointer is 64 bits: no sign from eax
    ],
)
def test_linux_612_register_returns_a_pointer_or_err_ptr(ret: int, error: int) -> None:
    assert register_error(V612, ret) == error


def test_last_call_parses_what_call_data_writes() -> None:
    raw = bytearray(call_data(0xFFFF_FFFF_8130_0000, (INODE, OFFSET, 0, BLOCK), BLOCK))
    assert len(raw) == BLOCK_QUEUE - BLOCK_FN
    assert LastCall.parse(bytes(raw)) == LastCall(0xFFFF_FFFF_8130_0000, BLOCK, 0, False, False)
    # What the queue stub and the work function write after it.
    raw[-8:] = (1).to_bytes(8, "little")  # BLOCK_QUEUED
    assert LastCall.parse(bytes(raw)) == LastCall(0xFFFF_FFFF_8130_0000, BLOCK, 0, False, True)
    raw[8 + 8 * MAX_ARGS : 16 + 8 * MAX_ARGS] = HANDLE.to_bytes(8, "little")  # BLOCK_RET
    raw[16 + 8 * MAX_ARGS : 24 + 8 * MAX_ARGS] = (1).to_bytes(8, "little")  # BLOCK_DONE
    assert LastCall.parse(bytes(raw)) == LastCall(0xFFFF_FFFF_8130_0000, BLOCK, HANDLE, True, True)


def test_call_data_lays_out_the_call_fields() -> None:
    words = [int.from_bytes(call_data(0x10, (1, -1), 7)[i : i + 8], "little") for i in range(0, 72, 8)]
    # fn, four args (missing ones 0, a negative one as its u64), ret 0, not done, the tag, not queued.
    assert words == [0x10, 1, MASK, 0, 0, 0, 0, 7, 0]
    assert len(call_data(0x10, (), 0)) == 8 * (1 + MAX_ARGS + 4)
    with pytest.raises(TargetError, match="at most 4 arguments"):
        call_data(0x10, (1, 2, 3, 4, 5), 0)


def test_a_nonzero_done_or_queued_word_counts_as_set() -> None:
    raw = bytes(BLOCK_QUEUE - BLOCK_FN - 16) + (2).to_bytes(8, "little") + (MASK).to_bytes(8, "little")
    last = LastCall.parse(raw)
    assert last.queued and not last.done and last.tag == 2


def block_words(**at: int) -> bytes:
    raw = bytearray(C_SIZE)
    for off, value in ((C_INODE, at.get("inode", 0)), (C_OFFSET, at.get("offset", 0)),
                       (C_HANDLE, at.get("handle", 0)), (C_STATE, at.get("state", 0))):  # fmt: skip
        raw[off : off + 8] = value.to_bytes(8, "little")
    return bytes(raw)


@pytest.mark.parametrize("state", [S_NEW, S_IGRAB, S_REGISTER, S_ARMED, S_UNREGISTER, S_SYNC, S_IPUT])
def test_registration_parses_the_block_words(state: int) -> None:
    raw = bytearray(block_words(inode=INODE, offset=OFFSET, handle=HANDLE, state=state))
    raw[:C_INODE] = b"\xaa" * C_INODE  # the consumer and the counter are not the registration's words
    assert Registration.parse(BLOCK, bytes(raw)) == Registration(BLOCK, None, INODE, OFFSET, HANDLE, state)


def test_registration_of_a_fresh_block_is_new() -> None:
    assert Registration.parse(BLOCK, bytes(C_SIZE)) == Registration(BLOCK, None)


ADDRESS = {"igrab": 0x100, "uprobe_register": 0x200, "uprobe_unregister": 0x300, "uprobe_unregister_nosync": 0x400,
           "uprobe_unregister_sync": 0x500, "iput": 0x600}  # fmt: skip


@pytest.mark.parametrize(
    ("api", "state", "last", "want"),
    [
        # The state's own call, this registration's, queued and done: made.
        (V612, S_REGISTER, LastCall(0x200, BLOCK, HANDLE, True, True), (True, HANDLE)),
        (V61, S_UNREGISTER, LastCall(0x300, BLOCK, 0, True, True), (True, 0)),
        (V612, S_UNREGISTER, LastCall(0x400, BLOCK, 0, True, True), (True, 0)),
        # The registration's previous call (its state written, its call not yet): never made.
        (V612, S_REGISTER, LastCall(0x100, BLOCK, INODE, True, True), (False, 0)),
        (V612, S_SYNC, LastCall(0x400, BLOCK, 0, True, True), (False, 0)),
        (V61, S_IPUT, LastCall(0x300, BLOCK, 0, True, True), (False, 0)),
        # Another registration's call: never made.
        (V61, S_UNREGISTER, LastCall(0x300, BLOCK + C_SIZE, 0, True, True), (False, 0)),
        (V612, S_IGRAB, LastCall(0x100, BLOCK + C_SIZE, INODE, True, True), (False, 0)),
        # Written, never queued: never made.
        (V612, S_IPUT, LastCall(0x600, BLOCK, 0, False, False), (False, 0)),
        # No call at this step.
        (V612, S_ARMED, LastCall(0x200, BLOCK, HANDLE, True, True), (True, 0)),
        (V61, S_NEW, LastCall(0, 0, 0, False, False), (True, 0)),
    ],
)
def test_left_call_is_the_states_only_if_its_tag_and_function_are(
    api: UprobeApi, state: int, last: LastCall, want: tuple[bool, int]
) -> None:
    reg = Registration(BLOCK, None, INODE, OFFSET, HANDLE, state)
    assert left_call(api, reg, last, ADDRESS.__getitem__) == want
