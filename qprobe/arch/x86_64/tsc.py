"""Where x86 code has just read the time stamp counter: the instruction after an ``rdtsc``."""

from __future__ import annotations

from iced_x86 import Decoder, Mnemonic


def after_rdtsc(code: bytes, address: int) -> int | None:
    """The address of the instruction right after the first plain ``rdtsc`` in ``code`` (at ``address``).

    There ``edx:eax`` hold the counter just read.  None if ``code`` has no ``rdtsc``
    (an ``rdtscp`` also writes ``ecx`` and is not taken: one shape, one reader).
    """
    decoder = Decoder(64, code, ip=address)
    for insn in decoder:
        if insn.mnemonic == Mnemonic.RDTSC:
            return insn.next_ip
    return None


__all__ = ["after_rdtsc"]
