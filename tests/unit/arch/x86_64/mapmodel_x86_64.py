"""The host's model of an in-guest map (qprobe.arch.x86_64.guestagg), and the maps and hits to check the code
that folds them against it, for the tests that run that code."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from qprobe.arch.inguest import KeyPart, KeySpec, MapSlot
from qprobe.arch.x86_64.guestagg import part_words, typed
from qprobe.arch.x86_64.guestfilter import GPRS
from qprobe.arch.x86_64.ptregs import GDB_NAME

# One hit: the registers (gdb names) the key and value are read from, the CPU, the task's pid and comm.
Hit = tuple[dict[str, int], int, int, bytes]


def model(spec: KeySpec, hits: Iterable[Hit]) -> dict[tuple[int, ...], MapSlot]:
    """What the CPUs' tables hold after ``hits``, summed over the CPUs: each key's words from ``part_words``."""
    out: dict[tuple[int, ...], MapSlot] = {}
    for regs, cpu, pid, comm in hits:
        words: tuple[int, ...] = ()
        for part in spec.parts:
            raw = regs[GDB_NAME[part.reg]] if part.reg else 0
            words += part_words(part, raw, cpu=cpu, pid=pid, comm=comm)
        v = spec.value
        value = 0 if v is None else typed(v, regs[GDB_NAME[v.reg]])
        one = MapSlot(1, value, value, value) if v is not None else MapSlot(1)
        out[words] = one if words not in out else out[words].merge(one)
    if spec.value is not None:  # the guest's sum wraps at 64 bits, read as the value's type
        out = {k: MapSlot(s.count, typed(KeyPart("reg", signed=spec.value.signed), s.total), s.min, s.max)
               for k, s in out.items()}  # fmt: skip
    return out


# Any map guest_key may ask for (registers by pt_regs name), and register values and tasks to fold into it.
REG_PARTS = st.builds(lambda kind, reg, bits, signed: KeyPart(kind, reg, bits, signed),
                      st.sampled_from(["reg", "hist"]), st.sampled_from(GPRS), st.sampled_from([8, 16, 32, 64]),
                      st.booleans())  # fmt: skip
PARTS = st.one_of(REG_PARTS, st.sampled_from([KeyPart("cpu"), KeyPart("pid"), KeyPart("comm")]))
VALUE_PARTS = st.builds(lambda reg, bits, signed: KeyPart("reg", reg, bits, signed), st.sampled_from(GPRS),
                        st.sampled_from([8, 16, 32, 64]), st.booleans())  # fmt: skip
SPECS = st.builds(lambda parts, value: KeySpec(tuple(parts), value), st.lists(PARTS, max_size=3),
                  st.one_of(st.none(), VALUE_PARTS))  # fmt: skip
VALUES = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 40), st.integers(2**64 - 40, 2**64 - 1),
                   st.sampled_from([0, 1, 2, 3, 0x80, 0xFF, 0x8000, 0x7FFFFFFF, 0x80000000, 2**63]))  # fmt: skip
TASKS = st.tuples(st.integers(0, 2**31 - 1), st.sampled_from([b"workload", b"sh", b"kworker/0:1H-kb", b""]))
