"""What each image lacks, and why: the reviewed list that lets a skip stand under ``--qprobe-no-skip``.

A TOML file, one table per image, one line per fact the image lacks, with the reason it lacks it::

    ["minimal-6.12"]
    CONFIG_KPROBE_EVENTS = "tinyconfig-based (scripts/build-minimal-kernel.sh): no tracing at all"

A skip on an image passes as a skip only when its reason names one of the facts listed for that image,
as a whole word (``CONFIG_KPROBES`` is not named by ``CONFIG_KPROBES_ON_FTRACE``); every other skip is
a failure.  The fact is written as the skip reasons write it: a config option, a symbol name.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


class LacksError(ValueError):
    """The list cannot be used: the message is one line that names the file."""


@dataclass
class Lacks:
    path: Path
    facts: dict[str, dict[str, str]]  # image -> fact -> why the image lacks it
    _words: dict[tuple[str, str], re.Pattern[str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._words = {(image, fact): re.compile(rf"(?<!\w){re.escape(fact)}(?!\w)")
                       for image, facts in self.facts.items() for fact in facts}  # fmt: skip

    @classmethod
    def load(cls, path: Path, images: Iterable[str]) -> Lacks:
        """Read and check the list; ``images`` are the known image names (a misspelt one would excuse nothing)."""
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise LacksError(f"{path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise LacksError(f"{path} is not UTF-8 (byte {exc.start})") from None
        except OSError as exc:
            raise LacksError(f"cannot read {path}: {exc.strerror}") from None
        known = set(images)
        facts: dict[str, dict[str, str]] = {}
        for image, table in data.items():
            if image not in known:
                raise LacksError(f"{path}: unknown image {image!r}; known: {', '.join(sorted(known))}")
            if not isinstance(table, dict):
                raise LacksError(f'{path}: [{image!r}] must be a table of fact = "why the image lacks it"')
            for fact, why in table.items():
                if not fact or fact != fact.strip() or "\n" in fact:
                    raise LacksError(f"{path}: [{image!r}]: a fact is a word or name as the skip reasons write it, "
                                     f"not {fact!r}")  # fmt: skip
                if not isinstance(why, str) or not why.strip():
                    raise LacksError(f"{path}: [{image!r}] {fact}: give the reason the image lacks it, as a string")
            facts[image] = dict(table)
        return cls(path, facts)

    def named(self, image: str, reason: str) -> str | None:
        """The fact listed for ``image`` that ``reason`` names as a whole word, or None."""
        for fact in self.facts.get(image, {}):
            if self._words[(image, fact)].search(reason):
                return fact
        return None

    def unused(self, images: Iterable[str], used: set[tuple[str, str]]) -> list[str]:
        """``image: fact`` for each fact listed for one of ``images`` that no (image, fact) of ``used`` is."""
        return [f"{image}: {fact}" for image in images for fact in self.facts.get(image, {})
                if (image, fact) not in used]  # fmt: skip
