"""The kernel's number parsers and ctype tests, bug for bug.

The probe parser accepts or rejects a definition depending on exactly how
lib/kstrtox.c and lib/vsprintf.c read numbers (``0x`` / leading-``0`` radix
guessing, a lone leading ``+``, 64-bit wrap-around, one trailing newline), so
Python's ``int()`` cannot be used: ``"0x"``, ``"08"`` or ``"1_0"`` would be
judged differently.  Every function returns ``None`` where the kernel
returns ``-EINVAL``/``-ERANGE``.

The ctype helpers are ASCII-only: kernel ctype also classifies Latin-1
bytes, but a Python ``str`` holds code points, not the UTF-8 bytes the kernel
would see, so non-ASCII characters are simply never letters, digits or
spaces here.
"""

from __future__ import annotations

U64_MASK = (1 << 64) - 1
_SPACES = frozenset(" \t\n\v\f\r")


def isdigit(c: str) -> bool:
    """``isdigit()`` of the first character; False for an empty string (C's NUL)."""
    return c[:1] != "" and "0" <= c[0] <= "9"


def isalpha(c: str) -> bool:
    """``isalpha()`` of the first character, ASCII only."""
    return c[:1] != "" and ("a" <= c[0] <= "z" or "A" <= c[0] <= "Z")


def isspace(c: str) -> bool:
    """``isspace()`` of the first character, as argv_split() uses it."""
    return c[:1] in _SPACES and c[:1] != ""


def is_good_name(name: str, hash_ok: bool = False) -> bool:
    """trace.h ``__is_good_name``: a C identifier (``-`` allowed for systems)."""
    if not name:
        return False
    first = name[0]
    if not isalpha(first) and first != "_" and (not hash_ok or first != "-"):
        return False
    return all(isalpha(c) or isdigit(c) or c == "_" or (hash_ok and c == "-") for c in name[1:])


def _fixup_radix(s: str, base: int) -> tuple[str, int]:
    """lib/kstrtox.c ``_parse_integer_fixup_radix``."""
    if base == 0 and s[:1] != "0":
        base = 10
    elif base == 0:
        base = 16 if s[1:2].lower() == "x" and _hexval(s[2:3]) is not None else 8
    if base == 16 and s[:1] == "0" and s[1:2].lower() == "x":
        s = s[2:]
    return s, base


def _hexval(c: str) -> int | None:
    if isdigit(c):
        return ord(c[0]) - ord("0")
    if c[:1] != "" and "a" <= c[0].lower() <= "f" and c[0].isascii():
        return ord(c[0].lower()) - ord("a") + 10
    return None


def _parse_integer(s: str, base: int) -> tuple[int, int, bool]:
    """lib/kstrtox.c ``_parse_integer``: (value mod 2**64, chars used, overflowed)."""
    res = 0
    used = 0
    overflow = False
    for c in s:
        val = _hexval(c)
        if val is None or val >= base:
            break
        if res * base + val > U64_MASK:
            overflow = True
        res = (res * base + val) & U64_MASK
        used += 1
    return res, used, overflow


def _kstrtoull(s: str, base: int) -> int | None:
    s, base = _fixup_radix(s, base)
    value, used, overflow = _parse_integer(s, base)
    if overflow or used == 0:
        return None
    rest = s[used:]
    if rest[:1] == "\n":
        rest = rest[1:]
    return None if rest else value


def kstrtoull(s: str, base: int = 0) -> int | None:
    """``kstrtoull``/``kstrtoul`` on x86_64: one leading ``+`` is allowed."""
    if s[:1] == "+":
        s = s[1:]
    return _kstrtoull(s, base)


kstrtoul = kstrtoull


def kstrtoll(s: str, base: int = 0) -> int | None:
    """``kstrtoll``/``kstrtol`` on x86_64, returning a Python (signed) int."""
    if s[:1] == "-":
        tmp = _kstrtoull(s[1:], base)
        if tmp is None:
            return None
        neg = (-tmp) & U64_MASK
        if 0 < neg < (1 << 63):  # (long long)-tmp > 0
            return None
        return neg - (1 << 64) if neg >= (1 << 63) else neg
    tmp = kstrtoull(s, base)
    if tmp is None or tmp >= (1 << 63):
        return None
    return tmp


kstrtol = kstrtoll


def kstrtouint(s: str, base: int = 0) -> int | None:
    """``kstrtouint``: like kstrtoull but the value must fit in 32 bits."""
    value = kstrtoull(s, base)
    if value is None or value > 0xFFFF_FFFF:
        return None
    return value


def simple_strtoul(s: str, base: int = 0) -> tuple[int, int]:
    """``simple_strtoul``: (value, index of the first unparsed character).

    Unlike kstrto*, this never fails: it stops at the first bad character and
    wraps silently on overflow, which is what the bitfield parser relies on.
    """
    rest, base = _fixup_radix(s, base)
    value, used, _ = _parse_integer(rest, base)
    return value, len(s) - len(rest) + used


def to_s32(value: int) -> int:
    """Truncate to a C ``int`` (the fetch_insn ``offset`` field is one)."""
    value &= 0xFFFF_FFFF
    return value - (1 << 32) if value & 0x8000_0000 else value


def split_args(line: str) -> list[tuple[int, str]]:
    """lib/argv_split.c with each word's start column kept for error carets."""
    out: list[tuple[int, str]] = []
    start = -1
    for i, c in enumerate(line):
        if c in _SPACES:
            if start >= 0:
                out.append((start, line[start:i]))
                start = -1
        elif start < 0:
            start = i
    if start >= 0:
        out.append((start, line[start:]))
    return out
