"""What one kernel's kprobe_events accepts beyond 6.1's base language, and how it words its errors.

Stable kernels take backports (Debian's 6.1.192 has ``:symstr`` and spells
"Invalid $-variable specified", which 6.1.0 misspelt), so the version number
does not say what a kernel's parser does.  A :class:`Dialect` holds what the
running kernel itself says: the fetch types its tracefs ``README`` lists and
the texts of its ``trace_probe_err_text`` table.  ``qprobe.kernel.tracefs``
reads both from vmlinux; without them (:data:`BASE`) the parser is 6.1.0's.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

# Fetch types that are not in 6.1.0 and that a kernel's README may list.
OPTIONAL_TYPES = ("symstr",)


@dataclass(frozen=True)
class Dialect:
    """``types``: optional fetch types the kernel accepts; ``messages``: its error texts (None: 6.1.0's)."""

    types: frozenset[str] = frozenset()
    messages: frozenset[str] | None = None

    def has(self, text: str) -> bool:
        """Whether the kernel's error table has this text (so it has the check that logs it)."""
        return self.messages is not None and text in self.messages

    def message(self, text: str) -> str:
        """The kernel's wording of one of qprobe's (6.1.0) error texts.

        A text the kernel's table lacks is matched to the table's closest one
        (the later wording of the same error, such as a typo fix); a text with
        no close match (one of qprobe's own) is kept.
        """
        if self.messages is None or text in self.messages:
            return text
        close = difflib.get_close_matches(text, self.messages, n=1, cutoff=0.9)
        return close[0] if close else text


BASE = Dialect()


def readme_types(readme: str) -> frozenset[str]:
    """The fetch types a tracefs README lists after ``type:`` (``s8/16/32/64`` gives s8 ... s64)."""
    m = re.search(r"^\s*type:(.*?)(?:<type>|^\s*\w+:)", readme, re.M | re.S)
    if m is None:
        return frozenset()
    out: set[str] = set()
    for word in re.split(r"[,\s]+", m.group(1)):
        first, *sizes = word.split("/")
        base = re.match(r"([a-z]+)(\d*)$", first)
        if base is None:
            continue
        out.add(first)
        if base.group(2):
            out.update(base.group(1) + s for s in sizes if s.isdigit())
    return frozenset(out)


def dialect_of(readme: str | None, messages: list[str] | None) -> Dialect:
    """The Dialect of a kernel from its README text and its error-text table (either may be unknown)."""
    types = readme_types(readme) if readme else frozenset()
    return Dialect(frozenset(t for t in OPTIONAL_TYPES if t in types),
                   frozenset(messages) if messages else None)  # fmt: skip
