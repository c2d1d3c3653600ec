"""A probe definition's text parsed once: the typed head every front end and the events layer share.

``parse_definition`` tokenises a kprobe_events or uprobe_events line as the kernel's
``argv_split`` does (each word's column kept for the error log's caret) and names its
parts: the head (``p[MAXACT][:[GRP/]EVENT]``), the probe point as what it is (a symbol,
an address, a glob, a point in a file) and the argument words.  Nothing here is judged
as the kernel judges it: :func:`qprobe.fetch.parse_event` and
:func:`qprobe.fetch.parse_uprobe_event` do that on a Definition, so a definition is read
from its text once however many steps look at it (the front end's, the glob's expansion,
the checks against the running kernel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qprobe.errors import FetchArgError

from .kstrto import kstrtoul, split_args

_GLOB = re.compile(r"[*?\[]")

Word = tuple[int, str]  # a word and its column in the definition's text


def is_glob(name: str) -> bool:
    """Is ``name`` a shell-style pattern (``vfs_*``, ``ksys_?ead``, ``do_[rw]*``) rather than one symbol?"""
    return bool(_GLOB.search(name))


@dataclass(frozen=True)
class Symbol:
    """``SYM[+OFFS]``: ``offset`` None when what follows the name is no offset the kernel takes."""

    name: str
    offset: int | None


@dataclass(frozen=True)
class Address:
    """A probe on a kernel address: ``0xffffffff81234560``."""

    addr: int


@dataclass(frozen=True)
class Glob:
    """A pattern of function names: one event per function (``vfs_*``)."""

    pattern: str


@dataclass(frozen=True)
class FilePoint:
    """``PATH:TARGET``: a uprobe's file and what follows its last ``:`` (an offset, or a symbol qprobe
    resolves in the file, with ``(REF_CTR)`` and ``%return`` when given)."""

    path: str
    target: str


Point = Symbol | Address | Glob | FilePoint


@dataclass(frozen=True)
class Definition:
    """One definition line: its text as given, its words (comment stripped) and its probe point."""

    text: str
    words: tuple[Word, ...]

    @property
    def head(self) -> str:
        """The first word (``p:grp/ev``, ``r16``, ``-:ev``), "" for an empty line."""
        return self.words[0][1] if self.words else ""

    @property
    def kind(self) -> str:
        """The head's first character: ``p``, ``r``, ``-`` or whatever else was typed."""
        return self.head[:1]

    @property
    def name(self) -> str | None:
        """What follows the head's ``:`` (``GRP/EVENT``, ``EVENT``, ``GRP/``), None without one."""
        colon = self.head.find(":", 1)
        return self.head[colon + 1 :] if colon >= 0 else None

    @property
    def point_column(self) -> int:
        """The probe point's column, 0 without one (where the kernel's caret goes then)."""
        return self.words[1][0] if len(self.words) > 1 else 0

    @property
    def point_word(self) -> str | None:
        """The probe point as written (``vfs_read+16``, ``/bin/ls:0x10(0x20)``), None without one."""
        return self.words[1][1] if len(self.words) > 1 else None

    @property
    def place_name(self) -> str | None:
        """The probe point's name without ``+OFFS``/``%return`` (``vfs_*`` for ``vfs_*%return``)."""
        word = self.point_word
        return None if word is None else re.split(r"[+%]", word, maxsplit=1)[0]

    @property
    def point(self) -> Point | None:
        """The probe point, typed; None without one."""
        word = self.point_word
        return None if word is None else point_of(word)

    @property
    def args(self) -> tuple[Word, ...]:
        """The argument words after the probe point, each with its column."""
        return self.words[2:]

    @property
    def is_uprobe(self) -> bool:
        """Whether the probe point is a path (uprobe_events': ``p:ev /bin/prog:0x1136``)."""
        return isinstance(self.point, FilePoint)

    @property
    def is_wildcard(self) -> bool:
        """Whether the probe point is a glob: one event per function (``add_events``)."""
        return isinstance(self.point, Glob)

    def replaced(self, index: int, start: int, end: int, new: str) -> Definition:
        """This definition with ``word[start:end]`` of word ``index`` made ``new``: the text rewritten and the
        words' columns moved, not read again (a glob's function put in, a uprobe's symbol resolved)."""
        col, word = self.words[index]
        shift = len(new) - (end - start)
        text = self.text[: col + start] + new + self.text[col + end :]
        words = [
            (c + shift if i > index else c, word[:start] + new + word[end:] if i == index else w)
            for i, (c, w) in enumerate(self.words)
        ]
        return Definition(text, tuple(words))

    def with_point(self, head: str, point: str, end: int) -> Definition:
        """``HEAD POINT`` in place of the text up to ``end`` characters into the probe point word, the rest
        (the point's ``+OFFS``/``%return``, the arguments, a comment) kept: a glob's function put in.  The
        columns are moved, the text not read again."""
        col, word = self.words[1]
        start = f"{head} {point}"
        shift = len(start) - (col + end)
        words = ((0, head), (len(head) + 1, point + word[end:]), *((c + shift, w) for c, w in self.words[2:]))
        return Definition(start + self.text[col + end :], words)


def point_of(word: str) -> Point:
    """What a probe point word names: a path (a uprobe's), an address, a glob or a symbol."""
    if word.startswith("/"):
        colon = word.rfind(":")
        return FilePoint(word[:colon], word[colon + 1 :]) if colon >= 0 else FilePoint(word, "")
    addr = kstrtoul(word, 0)
    if addr is not None:
        return Address(addr)
    parts = re.split(r"([+%])", word, maxsplit=1)
    if is_glob(parts[0]):
        return Glob(parts[0])
    offset = kstrtoul(parts[2].split("%", 1)[0], 0) if len(parts) > 1 and parts[1] == "+" else 0
    return Symbol(parts[0], offset)


def parse_definition(text: str) -> Definition:
    """``text`` (one line, a trailing newline allowed) tokenised once; a ``#`` comment is not part of it.

    Raises FetchArgError for more than one line, as the kernel's parsers would first.
    """
    return Definition(text, tuple(split_args(strip_line(text))))


def strip_line(text: str) -> str:
    """The line without its trailing newline and ``#`` comment; more than one line is refused."""
    line = text[:-1] if text.endswith("\n") else text
    if "\n" in line:
        raise FetchArgError("One definition per line (use parse_events)", text, line.index("\n"))
    hash_at = line.find("#")
    return line if hash_at < 0 else line[:hash_at]
