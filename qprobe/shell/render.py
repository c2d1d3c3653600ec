"""Pure text rendering for the shell: bpftrace maps and histograms, xxd dumps, registers.

Nothing here touches a target; every function takes plain values and returns
the text, so the formats are tested without a VM.  The histogram and map
formats are transcribed from bpftrace's ``TextOutput`` (src/output.cpp):
``hist_to_str``, ``hist_index_label``, ``map_keyval_to_str`` and the
``@name[key]: value`` map lines sorted by value, smallest first.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import drgn

    from qprobe.arch import RegisterLayout

HIST_BAR_WIDTH = 52  # bpftrace's max_width
STACK_INDENT = 8  # bpftrace prints kstack frames indented by 8 spaces


class KeyParts(tuple):  # type: ignore[type-arg]
    """A key of several parts (``by $comm, fd``), printed ``@[cat, 3]`` as bpftrace prints a tuple key."""

    __slots__ = ()


MapKey = str | int | tuple[str, ...] | KeyParts | None


# -- log2 histograms ---------------------------------------------------------------
def log2_bucket(value: int) -> int:
    """bpftrace's hist() bucket index: 0 for negatives, 1 for 0, 2 for 1, then 2 + floor(log2(v))."""
    if value < 0:
        return 0
    if value == 0:
        return 1
    return value.bit_length() + 1


def hist_index_label(power: int) -> str:
    """``1``, ``2``, ... ``512``, ``1K``, ``2K``, ... ``1M``, ``1G``, ``1T``; 2**50 is ``1024T`` as in bpftrace."""
    suffix = ""
    for threshold, letter in ((40, "T"), (30, "G"), (20, "M"), (10, "K")):
        if power >= threshold:
            suffix = letter
            power -= threshold
            break
    return f"{1 << power}{suffix}"


def bucket_label(index: int) -> str:
    """The row header of bucket ``index``: ``(..., 0)``, ``[0]``, ``[1]``, ``[2, 4)``, ``[1K, 2K)``."""
    if index == 0:
        return "(..., 0)"
    if index == 1:
        return "[0]"
    if index == 2:
        return "[1]"
    return f"[{hist_index_label(index - 2)}, {hist_index_label(index - 1)})"


def _f32(x: float) -> float:
    """Round to IEEE single precision, as bpftrace's ``(float)`` arithmetic does."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def bar_width(count: int, max_count: int, width: int = HIST_BAR_WIDTH) -> int:
    """``int bar_width = values.at(i)/(float)max_value*max_width;`` in single precision, truncated."""
    if max_count <= 0:
        return 0
    return int(_f32(_f32(_f32(count) / _f32(max_count)) * width))


def hist_buckets(values: Iterable[int]) -> dict[int, int]:
    """Bucket index -> count for a sequence of integers."""
    out: dict[int, int] = {}
    for v in values:
        i = log2_bucket(v)
        out[i] = out.get(i, 0) + 1
    return out


def render_hist(buckets: Mapping[int, int]) -> str:
    """bpftrace's ``hist_to_str``: rows from the first to the last non-empty bucket, "" when empty."""
    used = [i for i, n in buckets.items() if n > 0]
    if not used:
        return ""
    top = max(buckets.values())
    rows = []
    for i in range(min(used), max(used) + 1):
        n = buckets.get(i, 0)
        bar = "@" * bar_width(n, top)
        rows.append(f"{bucket_label(i):<16}{n:>8} |{bar:<{HIST_BAR_WIDTH}}|\n")
    return "".join(rows)


def render_hist_map(name: str, hists: Mapping[MapKey, Mapping[int, int]]) -> str:
    """``@name: `` (or ``@name[key]: ``), a newline, the histogram; maps joined by a newline, ending in one.

    Keys print in increasing order of their total count, as bpftrace does.
    """
    order = sorted(hists, key=lambda k: (sum(hists[k].values()), format_key(k)))
    elems = [f"@{name}{_key_suffix(k)}: \n{render_hist(hists[k])}" for k in order]
    return "\n".join(elems) + "\n"


# -- count maps --------------------------------------------------------------------------
def format_key(key: MapKey) -> str:
    """How bpftrace prints a map key: strings bare, a stack as indented frames, tuples with ``, ``."""
    if key is None:
        return ""
    if isinstance(key, KeyParts):
        return ", ".join(format_key(part) for part in key)
    if isinstance(key, tuple):
        return "\n" + "".join(f"{' ' * STACK_INDENT}{frame}\n" for frame in key)
    return str(key)


def _key_suffix(key: MapKey) -> str:
    return "" if key is None else f"[{format_key(key)}]"


def sort_counts(counts: Mapping[MapKey, int]) -> list[tuple[MapKey, int]]:
    """Smallest count first (the biggest ends up next to the prompt), ties by key."""
    return sorted(counts.items(), key=lambda kv: (kv[1], _sort_key(kv[0])))


def _sort_key(key: MapKey) -> tuple[int, int, str]:
    if isinstance(key, int):
        return (0, key, "")
    return (1, 0, format_key(key))


def render_counts(name: str, counts: Mapping[MapKey, int]) -> str:
    """``@name[key]: value`` lines sorted by value; a key of None prints as ``@name: value``."""
    return "".join(f"@{name}{_key_suffix(k)}: {v}\n" for k, v in sort_counts(counts))


def render_stats(name: str, stats: Mapping[MapKey, tuple[int, int]]) -> str:
    """bpftrace's ``stats()`` map: ``@name[key]: count N, average A, total T``, sorted by total, smallest first."""
    rows = sorted(stats.items(), key=lambda kv: (kv[1][1], _sort_key(kv[0])))
    return "".join(f"@{name}{_key_suffix(k)}: count {n}, average {c_div(total, n)}, total {total}\n"
                   for k, (n, total) in rows)  # fmt: skip


def c_div(a: int, b: int) -> int:
    """C's integer division (truncating toward zero), as bpftrace's avg() and stats() divide; 0 for b == 0."""
    if b == 0:
        return 0
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


# -- linear histograms --------------------------------------------------------------------
def lhist_bucket(value: int, lo: int, hi: int, step: int) -> int:
    """bpftrace's lhist() index: 0 below ``lo``, ``(hi - lo) // step + 1`` above ``hi``, else ``(v - lo) // step + 1``.

    (So a ``(hi - lo)`` that ``step`` does not divide puts the top of the last range in the ``[hi, ...)`` row.)
    """
    if value < lo:
        return 0
    if value > hi:
        return (hi - lo) // step + 1
    return (value - lo) // step + 1


def lhist_index_label(number: int) -> str:
    """``0``, ``1M`` for whole mebi, ``1K`` for whole kibi, else the number (``lhist_index_label``)."""
    if number == 0:
        return "0"
    if number % (1 << 20) == 0:
        return f"{number >> 20}M"
    if number % 1024 == 0:
        return f"{number >> 10}K"
    return str(number)


def render_lhist(buckets: Mapping[int, int], lo: int, hi: int, step: int) -> str:
    """bpftrace's ``lhist_to_str``: rows from the first to the last non-empty bucket, "" when empty."""
    used = [i for i, n in buckets.items() if n > 0]
    if not used:
        return ""
    top = max(buckets.values())
    last = (hi - lo) // step + 1
    rows = []
    for i in range(min(used), max(used) + 1):
        if i == 0:
            label = f"(..., {lhist_index_label(lo)})"
        elif i == last:
            label = f"[{lhist_index_label(hi)}, ...)"
        else:
            label = f"[{lhist_index_label((i - 1) * step + lo)}, {lhist_index_label(i * step + lo)})"
        n = buckets.get(i, 0)
        rows.append(f"{label:<16}{n:>8} |{'@' * bar_width(n, top):<{HIST_BAR_WIDTH}}|\n")
    return "".join(rows)


def render_lhist_map(name: str, hists: Mapping[MapKey, Mapping[int, int]], lo: int, hi: int, step: int) -> str:
    """As ``render_hist_map``, with linear buckets."""
    order = sorted(hists, key=lambda k: (sum(hists[k].values()), format_key(k)))
    elems = [f"@{name}{_key_suffix(k)}: \n{render_lhist(hists[k], lo, hi, step)}" for k in order]
    return "\n".join(elems) + "\n"


def strip_quotes(text: str) -> str:
    """A string argument's value as bpftrace prints string keys: without ftrace's quotes."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def parse_number(text: str) -> int | None:
    """An ftrace-formatted integer (``123``, ``-5``, ``0x3e8``) or None (strings, arrays, faults)."""
    t = text.strip()
    try:
        return int(t, 16) if t.lower().startswith("0x") else int(t, 10)
    except ValueError:
        return None


def stack_frames(frames: Iterable[drgn.StackFrame]) -> tuple[str, ...]:
    """drgn's frames as bpftrace prints kstack entries (``sym+decimal offset``), real frames only."""
    out = []
    for frame in frames:
        if frame.is_inline:  # bpftrace's kstack lists return addresses, not inlined calls
            continue
        try:
            sym = frame.symbol()
        except LookupError:
            out.append(f"0x{frame.pc:x}")
            continue
        out.append(f"{sym.name}+{frame.pc - sym.address}")
    return tuple(out)


# -- memory and registers -----------------------------------------------------------------
def hexdump(addr: int, data: bytes, width: int = 16) -> str:
    """``xxd`` layout: address, 2-byte groups, two spaces, printable ASCII (others as ``.``)."""
    lines = []
    hex_width = width * 2 + (width // 2 - 1)
    for off in range(0, len(data), width):
        chunk = data[off : off + width]
        groups = " ".join(chunk[i : i + 2].hex() for i in range(0, len(chunk), 2))
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{addr + off:08x}: {groups:<{hex_width}}  {text}\n")
    return "".join(lines)


def flags_text(value: int, bits: Sequence[tuple[int, str]]) -> str:
    """gdb's ``[ IF ZF ]``: the names of the flags set, from the arch's (mask, name) pairs."""
    names = [name for mask, name in bits if value & mask]
    return "[ " + " ".join(names) + " ]" if names else "[ ]"


def render_registers(regs: Mapping[str, int], layout: RegisterLayout, symbolize: object = None) -> str:
    """gdb's ``info registers`` columns: name, hex, natural (signed, flags or ``<sym+off>``).

    The registers and how each is shown come from the arch's ``RegisterLayout.display``
    (the types its target description gives them: int, a code or data pointer, flags, or plain hex).
    """
    lines = []
    for name, kind in layout.display:
        if name not in regs:
            continue
        v = regs[name]
        if kind == "flags":
            natural = flags_text(v, layout.flag_bits)
        elif kind in ("code", "data"):
            where = symbolize(v) if callable(symbolize) and kind == "code" else None
            natural = f"{v:#x} <{where}>" if where else f"{v:#x}"
        elif kind == "hex":
            natural = f"{v:#x}"
        else:
            natural = str(v - (1 << 64) if v >> 63 else v)
        lines.append(f"{name:<15}{v:<#19x}{natural}\n")
    return "".join(lines)


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned first column, right-aligned numbers, two spaces apart."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for r in cells:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        out.append("  ".join(parts).rstrip() + "\n")
    return "".join(out)
