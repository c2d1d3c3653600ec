"""Ring handlers: an event's hits handed to Python in batches, off the record rings, nothing stopped.

Linux's name for this is the ring-buffer consumer: a BPF program (or perf)
writes each sample into a per-CPU ring and returns, and user space polls the
ring and calls ``sample_cb`` for what it finds, in another context and later
(libbpf's ``ring_buffer__new(map_fd, sample_cb, ctx, opts)`` and
``perf_buffer__new``).  Here the optimized probe's detour writes the record
(the registers the definition reads, the task's pid and comm, the cycle
counter) into its CPU's ring, the collector thread drains the rings, and
``sample_cb`` takes each drained run of one event's hits as one
:class:`Samples`: the values the definition fetches, column by column.  A
handler there can count, filter, histogram and log; it cannot change the hit,
which ran on long before (what must stop the guest takes a synchronous
handler: ``add_event``'s callback, a kprobe's ``pre_handler``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from qprobe.fetch.args import Value


class Sample(NamedTuple):
    """One hit of a :class:`Samples` batch, as a row."""

    cpu: int
    pid: int
    comm: str
    ts: float  # seconds on the guest's trace clock, as its trace lines print them
    args: dict[str, Value]  # the definition's arguments by name, typed as fetched (an s32 negative, a u64 not)


class Samples:
    """One event's hits from one drain of the rings, oldest first, as columns (one list a field, a hit an index).

    ``args`` maps each argument of the definition to its column of values as
    the definition types them: an integer (masked to its size, signed for
    ``s8``..``s64``), a string (``$comm``) or what ``FetchArg.evaluate`` makes
    of the rest.  ``ts`` is worked out from the records' cycle counter values
    when first read (the guest's clock as it is then): a handler that never
    reads it does not pay for it.  Iterating gives the hits as :class:`Sample`
    rows (slower: a tuple and a dict a hit).
    """

    __slots__ = ("_times", "_ts", "args", "comm", "cpu", "event", "pid")

    def __init__(self, event: str, cpu: list[int], pid: list[int], comm: list[str],
                 ts: list[float] | Callable[[], list[float]], args: dict[str, list[Value]]) -> None:  # fmt: skip
        self.event, self.cpu, self.pid, self.comm, self.args = event, cpu, pid, comm, args
        self._ts: list[float] | None = ts if isinstance(ts, list) else None
        self._times: Callable[[], list[float]] | None = None if isinstance(ts, list) else ts

    @property
    def ts(self) -> list[float]:
        """Each hit's time, in seconds on the guest's trace clock, as its trace lines print them."""
        if self._ts is None:
            assert self._times is not None
            self._ts, self._times = self._times(), None
        return self._ts

    def __len__(self) -> int:
        return len(self.cpu)

    def __iter__(self) -> Iterator[Sample]:
        names = list(self.args)
        columns = [self.args[n] for n in names]
        for i, (cpu, pid, comm, ts) in enumerate(zip(self.cpu, self.pid, self.comm, self.ts, strict=True)):
            yield Sample(cpu, pid, comm, ts, {n: col[i] for n, col in zip(names, columns, strict=True)})

    def __repr__(self) -> str:
        return f"<Samples {self.event}: {len(self)} hits>"


SampleCb = Callable[[Samples], object]  # libbpf's sample_cb: what it returns is ignored

__all__ = ["Sample", "SampleCb", "Samples"]
