"""The guest kernel's own kprobe_events, asked for verdicts and hits in the same VM as qprobe.

A batch of definitions is copied into the guest (base64, in chunks the serial
console takes), and one guest shell loop writes each line to
``kprobe_events`` and prints the kernel's answer: ``OK`` and the
``kprobe_events`` listing, or ``ERR`` and the ``error_log`` entry, whose
caret gives the column the kernel blames.  Cases are sequences of lines:
``kprobe_events`` is cleared after each case, so a case can ask about
definitions that meet an existing event.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import qprobe
from qprobe.errors import FetchArgError, QprobeError

from .conftest import workload_result

TRACING = "/sys/kernel/tracing"
CHUNK = 700  # base64 characters per console command (the tty line limit is 4095)

_SCRIPT = r"""T=%(tracing)s
while IFS= read -r line; do
  if [ "$line" = "@@CASE" ]; then echo > $T/%(events)s; echo "@@CASE"; continue; fi
  echo > $T/error_log
  if printf '%%s\n' "$line" >> $T/%(events)s 2>/dev/null; then
    echo "@@OK"; cat $T/%(events)s
  else
    echo "@@ERR"; cat $T/error_log
  fi
  echo "@@END"
done < %(defs)s
echo > $T/%(events)s
"""


# What the guest kernel's kprobe_events language has, as its tracefs README (kernel/trace/trace.c's readme_msg)
# lists it: read in the guest with these patterns, never asked of qprobe, whose reading of that text is
# part of what the tests check.  Name -> (pattern, what the kernel then has).
README_FACTS = {
    "btf_args": (r"^\s*<argname>", "function parameters by name (<argname>: CONFIG_PROBE_EVENTS_BTF_ARGS)"),
    "return_args": (r"return probes support:.*\$arg<N>", "$arg<N> in return probes"),
    # In the list after "type:", which ends with "<type>\[<array-size>\]" (its first "]").
    "dentry": (r"^\s*type:[^\]]*%pd/%pD", "%pd/%pD types"),
    "char": (r"^\s*type:[^\]]*\bchar\b", "char type"),
}


def enable_uprobe_events(target: qprobe.Target, *definitions: str) -> None:
    """The guest's own uprobe_events, exactly ``definitions`` (group uprobes), enabled, with an empty trace."""
    lines = "; ".join(f"echo '{d}' >> {TRACING}/uprobe_events" for d in definitions)
    target.run(f"echo > {TRACING}/trace; echo > {TRACING}/uprobe_events; {lines}; "
               f"echo 1 > {TRACING}/events/uprobes/enable").check()  # fmt: skip


def readme_lacks(target: qprobe.Target, *facts: str) -> str | None:
    """Why the guest's kprobe_events lacks one of ``facts`` (README_FACTS names), naming the image; or None."""
    image = target.image.name if target.image is not None else "the attached VM"
    out = target.run(f"test -e {TRACING}/README || mount -t tracefs none {TRACING} 2>/dev/null; "
                     f"cat {TRACING}/README")  # fmt: skip
    if out.status != 0:
        return f"image {image}: the guest has no {TRACING}/README: no tracefs (the kernel has no CONFIG_TRACING)"
    for fact in facts:
        pattern, what = README_FACTS[fact]
        if re.search(pattern, out.output, re.M) is None:
            return f"image {image}: the guest's {TRACING}/README lists no {what}"
    return None


@dataclass(frozen=True)
class Verdict:
    """Accepted (with the listing lines), or refused with the error_log message and caret column."""

    ok: bool
    message: str = ""
    column: int = -1
    listing: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "OK" if self.ok else f"ERR {self.message!r} at {self.column}"


def _put_file(target: qprobe.Target, path: str, data: bytes) -> None:
    text = base64.b64encode(data).decode()
    target.run(f": > {path}.b64").check()
    for i in range(0, len(text), CHUNK):
        target.run(f"printf '%s' '{text[i : i + CHUNK]}' >> {path}.b64").check()
    target.run(f"base64 -d {path}.b64 > {path} && rm {path}.b64").check()


def _parse_error_log(lines: list[str], subsystem: str) -> tuple[str, int]:
    """(message, caret column) of the one error_log entry: ``[ts] trace_kprobe: error: MSG``."""
    message, column, command_at = "", -1, -1
    for line in lines:
        m = re.search(rf"\] {subsystem}: error: (.*)$", line)
        if m:
            message = m.group(1).strip()
        elif line.startswith("  Command: "):
            command_at = len("  Command: ")
        elif line.strip() == "^" and command_at >= 0:
            column = line.index("^") - command_at
    return message, column


def guest_verdicts(
    target: qprobe.Target,
    cases: Sequence[Sequence[str]],
    events: str = "kprobe_events",
    subsystem: str = "trace_kprobe",
) -> list[list[Verdict]]:
    """The guest kernel's verdict on every line of every case, in order.

    ``events`` is the tracefs file written (``uprobe_events`` for uprobes, whose
    error_log entries come from the ``trace_uprobe`` subsystem).
    """
    lines: list[str] = []
    for case in cases:
        lines.extend(case)
        lines.append("@@CASE")
    _put_file(target, "/tmp/oracle-defs", ("\n".join(lines) + "\n").encode())
    _put_file(
        target,
        "/tmp/oracle.sh",
        (_SCRIPT % {"tracing": TRACING, "defs": "/tmp/oracle-defs", "events": events}).encode(),
    )
    out = target.run("sh /tmp/oracle.sh", timeout=600).check().output.splitlines()
    result: list[list[Verdict]] = [[]]
    i = 0
    while i < len(out):
        tag = out[i].strip()
        if tag == "@@CASE":
            result.append([])
        elif tag in ("@@OK", "@@ERR"):
            body: list[str] = []
            i += 1
            while i < len(out) and out[i].strip() != "@@END":
                body.append(out[i])
                i += 1
            if tag == "@@OK":
                result[-1].append(Verdict(True, listing=tuple(x for x in body if x.strip())))
            else:
                message, column = _parse_error_log(body, subsystem)
                result[-1].append(Verdict(False, message, column))
        i += 1
    result.pop()  # after the last @@CASE
    assert [len(r) for r in result] == [len(c) for c in cases], "the guest loop's output lost lines"
    return result


def qprobe_verdicts(target: qprobe.Target, cases: Sequence[Sequence[str]]) -> list[list[Verdict]]:
    """qprobe's verdict on the same cases: each line through ``Target.add_event``, events removed per case."""
    result = []
    for case in cases:
        got = []
        added = []
        for line in case:
            try:
                te = target.add_event(line)
            except FetchArgError as exc:
                got.append(Verdict(False, exc.reason if exc.logged else "", exc.column if exc.logged else -1))
            except QprobeError as exc:
                got.append(Verdict(False, f"qprobe: {exc}", -1))
            else:
                added.append(te)
                listing = "\n".join(t.listing() for t in target.events.values())
                got.append(Verdict(True, listing=tuple(listing.splitlines())))
        for te in added:
            if target.events.get(te.name) is te:  # removes the probes appended to it too
                target.remove_event(te)
        result.append(got)
    return result


# "  <comm>-<pid> [cpu] flags ts: event: body"; the comm may hold spaces and dashes.
TRACE_LINE = re.compile(
    r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+[\d.]+: (?P<event>\w+): (?P<body>.*)$"
)


def guest_hits(target: qprobe.Target, event: str) -> list[tuple[str, int, int, str]]:
    """The event's hits: (comm, pid, cpu, body); a string with newlines continues its hit's body on the next lines."""
    out = []
    mine = False
    # Lines end at "\n" only: a string's bytes may hold the other characters splitlines() breaks at.
    for line in target.run(f"cat {TRACING}/trace").check().output.removesuffix("\n").split("\n"):
        m = TRACE_LINE.match(line)
        if m:
            mine = m["event"] == event
            if mine:
                out.append((m["comm"].strip(), int(m["pid"]), int(m["cpu"]), m["body"]))
        elif mine:
            comm, pid, cpu, body = out[-1]
            out[-1] = (comm, pid, cpu, f"{body}\n{line}")
    return out


def paired_hits(target: qprobe.Target, body: str, workload: str) -> tuple[list[Any], list[Any], int, bool, int]:
    """The guest's ``ghit`` and qprobe's ``qhit`` with the same ``body``, each hit of the workload's process.

    Both see the same calls of the workload in the same order, so hit i of one is hit i of the other.
    Also returns whether qprobe's event is recorded in the guest, and how many of its hits had records
    longer than the guest's ring buffer takes (no line on either side).
    """
    te = target.add_event(f"p:qhit {body}")
    try:
        target.run(f"echo 'p:ghit {body}' >> {TRACING}/kprobe_events && echo > {TRACING}/trace && "
                   f"echo 1 > {TRACING}/events/kprobes/ghit/enable").check()  # fmt: skip
        res = workload_result(target.run(workload).check().output)
        target.run(f"echo 0 > {TRACING}/events/kprobes/ghit/enable").check()
        pid = int(res["pid"])
        guest = [h for h in guest_hits(target, "ghit") if h[1] == pid]  # before removing: that clears the buffer
    finally:
        target.remove_event(te)
        target.run(f"echo 0 > {TRACING}/events/kprobes/ghit/enable; echo '-:ghit' >> {TRACING}/kprobe_events")
    ours = [(h.comm, h.pid, h.cpu, h.body) for h in te.hits if h.pid == pid]
    return guest, ours, int(res["n"]), te.in_guest, te.oversized
