"""The registers a gdbstub describes (``qXfer:features:read:target.xml``), as both transports know them.

Offsets in the ``g`` packet come from the stub's own description, never guessed; GdbRemote reads it
here, and reading it is also what makes QEMU 7.2 answer ``p``/``P`` at all (its gdbstub serves them only to
a client that has read the XML: ``gdb_has_xml``).  GdbMiRemote has gdb read it and asks gdb for the result
(``maint print remote-registers``), in the same RegDesc.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from qprobe.errors import ProtocolError

__all__ = ["RegDesc", "TargetDescription", "read_target_description"]

_TAG = re.compile(r"<(xi:include|reg)\b([^>]*)>")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_ARCHITECTURE = re.compile(r"<architecture>\s*([\w:.+-]{1,64})\s*</architecture>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')
# Bounds on what a stub may send, so that a broken or hostile one cannot keep qprobe looping or growing
# forever.  QEMU 7.2 sends 2 description files in 2-3 chunks each and about 80 registers.
MAX_XFER_CHUNKS = 256
MAX_DESCRIPTION = 1 << 20  # bytes, all files together
MAX_INCLUDES = 32
MAX_REGISTERS = 512


@dataclass(frozen=True)
class RegDesc:
    name: str
    regnum: int
    bitsize: int
    offset: int  # byte offset in the ``g`` packet

    @property
    def size(self) -> int:
        return self.bitsize // 8


@dataclass
class TargetDescription:
    regs: dict[str, RegDesc]  # by name, in the description's order
    architecture: str  # as the description names it (<architecture>), "" if it does not


def _xfer(request: Callable[[bytes], bytes], annex: str, budget: list[int]) -> str:
    """One description file; ``budget`` is [chunks, bytes] left for the whole description."""
    data = b""
    while True:
        budget[0] -= 1
        if budget[0] < 0 or len(data) > budget[1]:
            raise ProtocolError(f"the gdbstub's target description is too long (at {annex}, {len(data)} bytes)")
        chunk = request(b"qXfer:features:read:%s:%x,%x" % (annex.encode(), len(data), 0xF00))
        if not chunk or chunk[:1] not in b"lm":
            raise ProtocolError(f"the gdbstub refused to send {annex}: {chunk[:40]!r}")
        if chunk[:1] == b"m" and len(chunk) == 1:
            raise ProtocolError(f"the gdbstub sent an empty chunk of {annex} and said there is more")
        data += chunk[1:]
        if chunk[:1] == b"l":
            budget[1] -= len(data)
            return data.decode(errors="replace")


def read_target_description(request: Callable[[bytes], bytes]) -> TargetDescription:
    """The stub's registers and architecture, from ``target.xml`` and the files it includes."""
    desc = TargetDescription({}, "")
    regnum = 0
    offset = 0
    budget = [MAX_XFER_CHUNKS, MAX_DESCRIPTION]
    included: list[str] = []

    def walk(annex: str) -> None:
        nonlocal regnum, offset
        if annex in included:
            raise ProtocolError(f"the gdbstub's target description includes {annex} twice (a loop?)")
        if len(included) >= MAX_INCLUDES or not re.fullmatch(r"[\w.-]{1,64}", annex):
            raise ProtocolError(f"the gdbstub's target description includes {annex[:40]!r}: refused")
        included.append(annex)
        # QEMU's target.xml uses an unbound ``xi:`` prefix, which an XML
        # parser rejects; the tags we need are flat, so read them in order.
        text = _COMMENT.sub("", _xfer(request, annex, budget))  # QEMU comments out cs_base..es_base
        arch = _ARCHITECTURE.search(text)
        if arch is not None:
            desc.architecture = arch[1]
        for tag, attrs in _TAG.findall(text):
            attrib = dict(_ATTR.findall(attrs))
            if tag == "xi:include":
                walk(attrib.get("href", ""))
            elif tag == "reg":
                regnum = _reg_field(attrib, "regnum", regnum, 0xFFFF)
                bits = _reg_field(attrib, "bitsize", None, 4096)
                name = attrib.get("name", "")
                if not bits or bits % 8 or not re.fullmatch(r"\w{1,32}", name) or len(desc.regs) >= MAX_REGISTERS:
                    raise ProtocolError(f"the gdbstub describes a register it cannot have: <reg{attrs[:60]}>")
                desc.regs[name] = RegDesc(name, regnum, bits, offset)
                regnum += 1
                offset += bits // 8

    walk("target.xml")
    return desc


def _reg_field(attrib: dict[str, str], key: str, default: int | None, limit: int) -> int:
    text = attrib.get(key)
    if text is None and default is not None:
        return default
    if text is None or not re.fullmatch(r"\d{1,6}", text) or int(text) > limit:
        raise ProtocolError(f"the gdbstub describes a register with {key}={text!r}")
    return int(text)
