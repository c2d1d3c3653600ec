"""Everything qprobe writes into the guest, recorded before it is written.

The journal is a small JSON file rewritten atomically on every change, so
that after any exit, even SIGKILL, the next attach to the same VM can put
back exactly the bytes qprobe replaced, and only where qprobe's bytes are
still there (a rebooted guest or a foreign patch is left alone).
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from qprobe.paths import cache_dir


@dataclass(frozen=True)
class Patch:
    phys: int
    virt: int
    old: bytes
    new: bytes
    what: str  # "int3", "pmd", ...
    slot: int = 0  # for an int3: where its instruction's copy runs out of line

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["old"], d["new"] = self.old.hex(), self.new.hex()
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Patch:
        return cls(int(d["phys"]), int(d["virt"]), bytes.fromhex(str(d["old"])),  # type: ignore[arg-type]
                   bytes.fromhex(str(d["new"])), str(d["what"]), int(d.get("slot", 0)))  # type: ignore[arg-type]  # fmt: skip


class Journal:
    """Live patches of one VM, keyed by its gdbstub address."""

    def __init__(self, key: str, identity: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[-120:]
        self.path = cache_dir("journal") / f"{safe}.json"
        self.identity = identity  # build-id and slide: a journal is only valid for that boot
        self.patches: dict[int, Patch] = {}
        self.meta: dict[str, int] = {}  # where the scratch area's stub and mailboxes are
        # Frequent data patches (kretprobe return addresses, one per call) are appended to a
        # log beside the snapshot instead of rewriting it; a snapshot save folds the log in.
        self.log_path = self.path.with_suffix(".log")
        self._log: int | None = None
        # The stop loop and the doorbell thread (kretprobe return addresses) both record patches.
        self._lock = threading.Lock()

    def load(self) -> tuple[str, list[Patch]]:
        """What an earlier qprobe left: (its identity, its live patches); its meta goes to ``left_meta``."""
        self.left_meta: dict[str, int] = {}
        try:
            data = json.loads(self.path.read_text())
            meta = {str(k): int(v) for k, v in data.get("meta", {}).items()}
            patches = {p.phys: p for p in (Patch.from_json(x) for x in data.get("patches", []))}
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return "", []  # unreadable: nothing we can trust to restore
        self._replay_log(patches)
        self.left_meta = meta
        return str(data.get("identity", "")), list(patches.values())

    def _replay_log(self, patches: dict[int, Patch]) -> None:
        try:
            lines = self.log_path.read_text().splitlines()
        except OSError:
            return
        for line in lines:
            try:
                if line.startswith("+"):
                    p = Patch.from_json(json.loads(line[1:]))
                    patches[p.phys] = p
                elif line.startswith("-"):
                    patches.pop(int(line[1:]), None)
            except (ValueError, KeyError, TypeError, AttributeError):
                return  # a torn last line: everything before it stands

    def set_meta(self, **values: int) -> None:
        self.meta.update(values)
        self._save()

    def _save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        payload = {"identity": self.identity, "meta": self.meta,
                   "patches": [p.to_json() for p in list(self.patches.values())]}  # fmt: skip
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
                self._log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(self._log, line.encode() + b"\n")

    def record_often(self, patch: Patch) -> None:
        """``record`` for a patch made on every probe hit: one appended line, not a rewrite."""
        self.patches[patch.phys] = patch
        self._append("+" + json.dumps(patch.to_json()))

    def forget_often(self, phys: int) -> None:
        if self.patches.pop(phys, None) is not None:
            self._append(f"-{phys}")

    def record(self, patch: Patch) -> None:
        self.patches[patch.phys] = patch
        self._save()

    def forget(self, phys: int) -> None:
        if self.patches.pop(phys, None) is not None:
            self._save()

    def clear(self) -> None:
        self.patches.clear()
        self.meta.clear()
        with self._lock:
            if self._log is not None:
                os.close(self._log)
                self._log = None
        Path(self.path).unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)
