"""Everything qprobe writes into the guest, recorded before it is written.

The journal is a small JSON file rewritten atomically on every change, so
that after any exit, even SIGKILL, the next attach to the same VM can put
back exactly the bytes qprobe replaced.

It is named after the VM itself, never after the address it was reached
by: ``unix:/run/gdb.sock``, ``/run/gdb.sock`` or another spelling of the
same VM find the same journal, and another boot of the same kernel (another
slide, another boot-time random canary) finds none.  A journal that cannot
be read is an error, never an empty journal: what it lists may still be in
the guest's text, waiting to oops it.

A journal is of use only while its VM runs, so it names its QEMU process as
(pid, start time) where that is known, and goes when the VM does: qprobe
removes it when it stops its own QEMU (the janitor does, if qprobe was
killed), and every start removes those whose QEMU no longer runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import QprobeError, TargetError
from qprobe.paths import cache_dir, open_nofollow, read_private
from qprobe.vmm.peer import still_running

MAX_PATCH = 64  # bytes of one patch: an int3 is 1, a jump 5, a page-table entry or return address 8
U64 = 1 << 64


class JournalError(TargetError):
    """An undo journal exists but cannot be trusted: qprobe will not touch the guest."""


@dataclass(frozen=True)
class Patch:
    phys: int
    virt: int
    old: bytes
    new: bytes
    what: str  # "int3", "pmd", ...
    slot: int = 0  # for an int3: where its instruction's copy runs out of line

    def to_json(self) -> dict[str, object]:
        # Not dataclasses.asdict: its deep copy was most of a journal write for a thousand patches.
        return {"phys": self.phys, "virt": self.virt, "old": self.old.hex(), "new": self.new.hex(),
                "what": self.what, "slot": self.slot}  # fmt: skip

    @classmethod
    def from_json(cls, d: object) -> Patch:
        """A patch from its JSON record; ValueError for anything but what ``to_json`` writes."""
        if not isinstance(d, dict):
            raise ValueError("a patch record is not an object")
        phys, virt, slot = d.get("phys"), d.get("virt"), d.get("slot", 0)
        old, new, what = d.get("old"), d.get("new"), d.get("what")
        for name, value in (("phys", phys), ("virt", virt), ("slot", slot)):
            if type(value) is not int or not 0 <= value < U64:
                raise ValueError(f"{name} is not an address: {value!r:.40}")
        if not isinstance(old, str) or not isinstance(new, str) or not isinstance(what, str):
            raise ValueError("old, new and what must be strings")
        before, after = bytes.fromhex(old), bytes.fromhex(new)
        if not 0 < len(before) == len(after) <= MAX_PATCH:
            raise ValueError(f"old and new bytes of different or impossible sizes ({len(before)}, {len(after)})")
        return cls(phys, virt, before, after, what, slot)  # type: ignore[arg-type]


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number a journal can hold")


class Journal:
    """Live patches of one VM, named by ``identity`` (what tells this boot of this VM from any other)."""

    def __init__(self, identity: str, qemu: tuple[int, int] | None = None) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", identity)[-160:]
        self.path = cache_dir("journal") / f"{safe}.json"
        self.identity = identity
        self.qemu = qemu  # the VM's QEMU as (pid, start time), when known: the sweep's test of whether it runs
        self.patches: dict[int, Patch] = {}
        self.meta: dict[str, int] = {}  # where the scratch area's stub and mailboxes are
        self.left_meta: dict[str, int] = {}
        # Frequent data patches (kretprobe return addresses, one per call) are appended to a
        # log beside the snapshot instead of rewriting it; a snapshot save folds the log in.
        self.log_path = self.path.with_suffix(".log")
        self._log: int | None = None
        self._batched = 0  # depth of batch() contexts
        self._batch_changed = False  # a patch recorded or forgotten since the outermost batch began
        # The stop loop and the doorbell thread (kretprobe return addresses) both record patches.
        self._lock = threading.Lock()

    def _unreadable(self, path: Path, why: str) -> JournalError:
        return JournalError(
            f"the undo journal {path} cannot be read ({why}); it may list int3s or jumps an earlier qprobe "
            "left in this guest's text: reboot the guest (or restore its text yourself), then delete the file"
        )

    def load(self) -> list[Patch]:
        """What an earlier qprobe left in this VM; its meta goes to ``left_meta``.  JournalError if unreadable."""
        self.left_meta = {}
        patches: dict[int, Patch] = {}
        raw = read_private(self.path)
        if raw is not None:
            try:
                data = json.loads(raw, parse_constant=_refuse_constant)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                if data.get("identity") != self.identity:
                    raise ValueError(f"it names another VM, {str(data.get('identity'))!r:.80}")
                meta = data.get("meta", {})
                if not isinstance(meta, dict) or not all(type(v) is int and 0 <= v < U64 for v in meta.values()):
                    raise ValueError("its meta is not a table of addresses")
                records = data.get("patches")
                if not isinstance(records, list):
                    raise ValueError("no list of patches")
                patches = {p.phys: p for p in map(Patch.from_json, records)}
            except (ValueError, RecursionError) as exc:
                raise self._unreadable(self.path, str(exc) or type(exc).__name__) from None
            self.left_meta = {str(k): v for k, v in meta.items()}
        self._replay_log(patches)
        return list(patches.values())

    def _replay_log(self, patches: dict[int, Patch]) -> None:
        raw = read_private(self.log_path)
        if raw is None:
            return
        # A line is complete once its newline is written; a last line without one was torn by a crash
        # mid-append, before the write into the guest it stands for: it is left out.
        lines = raw.decode(errors="replace").split("\n")[:-1]
        if lines and lines[0] != f"={self.identity}":
            raise self._unreadable(self.log_path, "it belongs to another VM or has no header")
        for n, line in enumerate(lines[1:], 2):
            try:
                if line.startswith("+"):
                    p = Patch.from_json(json.loads(line[1:], parse_constant=_refuse_constant))
                    patches[p.phys] = p
                elif line.startswith("-") and line[1:].isdigit():
                    patches.pop(int(line[1:]), None)
                else:
                    raise ValueError("neither + nor -")
            except (ValueError, RecursionError) as exc:
                raise self._unreadable(self.log_path, f"line {n}: {exc}") from None

    def set_meta(self, **values: int) -> None:
        self.meta.update(values)
        self._save()

    def _save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        payload: dict[str, object] = {"identity": self.identity, "meta": self.meta,
                   "patches": [p.to_json() for p in list(self.patches.values())]}  # fmt: skip
        if self.qemu is not None:
            payload["qemu"] = list(self.qemu)
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        # No fsync: the journal must survive the death of this process (the page
        # cache does that), not a host power cut, and it is rewritten per patch.
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, self.path)
        if self._log is not None:  # the snapshot now holds everything the log said
            os.close(self._log)
            self._log = None
            self.log_path.unlink(missing_ok=True)

    def _append(self, line: str) -> None:
        with self._lock:
            if self._log is None:
                # A log is only ever this session's: recovery has folded in and removed an earlier one.
                self._log = open_nofollow(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
                os.write(self._log, f"={self.identity}\n".encode())
            os.write(self._log, line.encode() + b"\n")

    def record_often(self, patch: Patch) -> None:
        """``record`` for a patch made on every probe hit: one appended line, not a rewrite."""
        self.patches[patch.phys] = patch
        self._append("+" + json.dumps(patch.to_json()))

    def forget_often(self, phys: int) -> None:
        if self.patches.pop(phys, None) is not None:
            self._append(f"-{phys}")

    def record(self, patch: Patch) -> None:
        if self._batched:
            self._batch_changed = True
            self.record_often(patch)
            return
        self.patches[patch.phys] = patch
        self._save()

    def forget(self, phys: int) -> None:
        if self._batched:
            self._batch_changed = True
            self.forget_often(phys)
        elif self.patches.pop(phys, None) is not None:
            self._save()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Many patches at once (a batch of probes): one appended line each, one snapshot at the end.

        A snapshot per patch made registering N probes O(N**2) in JSON (minutes for a thousand).
        A batch that changed nothing (an optimizer round that placed no jump) writes nothing.
        """
        if not self._batched:
            self._batch_changed = False
        self._batched += 1
        try:
            yield
        finally:
            self._batched -= 1
            if not self._batched and self._batch_changed:
                self._save()

    def files(self) -> list[Path]:
        """Every file this journal may have on disk."""
        return [self.path, self.log_path, self.path.with_suffix(".tmp")]

    def clear(self) -> None:
        self.patches.clear()
        self.meta.clear()
        with self._lock:
            if self._log is not None:
                os.close(self._log)
                self._log = None
        Path(self.path).unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)


def sweep_journals() -> list[Path]:
    """Remove the journals (and their logs) whose QEMU no longer runs; returns what was removed.

    A journal that names no QEMU (one written for a VM whose process could not be found) is left alone.
    """
    removed = []
    for path in cache_dir("journal").glob("*.json"):
        try:
            raw = read_private(path)
            qemu = json.loads(raw, parse_constant=_refuse_constant).get("qemu") if raw is not None else None
        except (QprobeError, ValueError, AttributeError, RecursionError):
            continue  # unreadable: load() says so to whoever attaches to its VM
        if not (isinstance(qemu, list) and len(qemu) == 2 and all(type(v) is int for v in qemu)):
            continue
        if still_running((qemu[0], qemu[1])):
            continue
        for stale in (path, path.with_suffix(".log"), path.with_suffix(".tmp")):
            stale.unlink(missing_ok=True)
        removed.append(path)
    return removed
