"""The guest-call side of the seam: code that makes the guest kernel call one of its own functions.

Some of what qprobe asks of the guest can only be done by the guest's own code in a context that may sleep:
``uprobe_register()`` takes the mm's locks, allocates and waits.  A stopped vCPU is in whatever context it
was interrupted in, so the host never calls from there.  Instead it makes one vCPU, at the end of an
interrupt (hard-irq context, where ``queue_work_on()`` is allowed), call the *queue stub*: it queues a work
item whose function is the *work function*, and a kworker later calls the block's function with its
arguments and stores the result and a done flag, which the host reads in RAM (qprobe.core.guestcall).

A block, in the scratch area: the ``struct work_struct`` (zeroed: the state of a work that last ran on pool
0 and is not pending, which every kernel's pool 0 makes valid), then the call::

    BLOCK_FN      the function's address   BLOCK_ARGS  four u64 arguments
    BLOCK_RET     its return value         BLOCK_DONE  set to 1 after it returned
    BLOCK_TAG     the caller's note of what the call is for
    BLOCK_QUEUED  set to 1 by the queue stub: the call will be made (a host killed before it was not)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from qprobe.arch.inguest import KeySpec

WORK_MAX = 64  # bytes kept for the work_struct (32 without lockdep, whose map a zeroed one lacks)
BLOCK_FN = WORK_MAX
BLOCK_ARGS = BLOCK_FN + 8
MAX_ARGS = 4
BLOCK_RET = BLOCK_ARGS + 8 * MAX_ARGS
BLOCK_DONE = BLOCK_RET + 8
BLOCK_TAG = BLOCK_DONE + 8
BLOCK_QUEUED = BLOCK_TAG + 8
BLOCK_QUEUE = BLOCK_QUEUED + 8  # the code follows the data (16-aligned)
BLOCK_WORK = 256
BLOCK_SIZE = 384


class GuestCall(Protocol):
    """``Arch.guest_call``: the code of guest calls, and how a stopped vCPU is made to run the queue stub."""

    # The function every interrupt's exit runs in hard-irq context, with interrupts off (the hijack point).
    interrupt_exit: str

    # The queue stub at ``address``: BLOCK_QUEUED set, queue_work_on(this CPU, *wq_var, work) and return, every
    # register kept (the block starts with ``work``).
    def build_queue_stub(self, address: int, queue_work_on: int, wq_var: int, work: int, cpu_number: int) -> bytes: ...
    # The work function at ``address``: the call described by the block its work_struct starts.
    def build_work_function(self, address: int) -> bytes: ...
    # A uprobe_consumer handler at ``address``: ``counter`` += 1, return 0 (keep the breakpoint).
    def build_count_handler(self, address: int, counter: int) -> bytes: ...
    # A uprobe_consumer handler at ``address`` that folds the hit into the per-CPU keyed tables at ``tables``
    # (GuestRam.guest_map_size(spec) bytes each; the key's registers from the pt_regs it is given) as an
    # optimized kprobe's keyed detour does, ``hits`` += 1 (``lost`` for a key with no free slot), return 0.
    def build_keyed_handler(self, address: int, spec: KeySpec, tables: int, cpu_number: int,
                            task: tuple[int, int, int], hits: int, lost: int) -> bytes: ...  # fmt: skip
    # A stopped vCPU (``regs``) made to call ``stub`` and come back to where it was: the stack pointer the
    # return address goes at, its bytes, and the registers to write (after the bytes).
    def arch_call_from(self, regs: Mapping[str, int], stub: int) -> tuple[int, bytes, dict[str, int]]: ...
