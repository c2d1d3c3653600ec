"""GdbRemote against a scripted QEMU 7.2 gdbstub on a socketpair."""

from __future__ import annotations

import os
import re
import select
from collections.abc import Iterator

import pytest
from vmm_fakes import (
    CLOSE,
    G_SIZE,
    I386_64BIT_XML,
    SILENT,
    TARGET_XML,
    X86_64_REGS,
    XML_SPLIT,
    QemuStub,
    g_offsets,
    pkt,
    wait_for,
)

from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import GuestTimeout, ProtocolError, TargetError, TargetGone
from qprobe.vmm.connection import Connection
from qprobe.vmm.gdbremote import BREAK_HW, BREAK_SW, WATCH_ACCESS, GdbRemote, drop_stale_breakpoints
from qprobe.vmm.rsp import StopReply
from qprobe.vmm.tdesc import RegDesc

KTEXT = 0xFFFF_FFFF_8100_0000
# The registers x86_64's Arch lets a G carry (qprobe.arch.x86_64.arch.PLAIN).
PLAIN = frozenset(("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", *(f"r{n}" for n in range(8, 16)), "rip",
                   "eflags"))  # fmt: skip


def connect(stub: QemuStub, handshake: bool = True) -> GdbRemote:
    gdb = GdbRemote(Connection(stub.client, name="fake"))
    if handshake:
        gdb.handshake()
    return gdb


@pytest.fixture
def stub() -> Iterator[QemuStub]:
    s = QemuStub(xfer_splits={"i386-64bit.xml": [XML_SPLIT]}, xfer_max=0xF00)
    yield s
    s.close()
    assert not s.errors, s.errors


@pytest.fixture
def gdb(stub: QemuStub) -> GdbRemote:
    gdb = connect(stub)
    gdb.allow_g(PLAIN)
    return gdb


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


# -- handshake and target description ------------------------------------------------


def test_handshake_survives_the_unsolicited_stop(stub: QemuStub) -> None:
    gdb = connect(stub, handshake=False)
    stop = gdb.handshake()
    assert stop == StopReply("T", 5, "p1.1", (("thread", "p01.01"),))
    assert gdb.packet_size == 0x1000
    assert gdb.running is False
    assert stub.requests[0].startswith(b"qSupported:")
    assert b"xmlRegisters=i386" in stub.requests[0]
    assert stub.requests[-2:] == [b"?", b"Qqemu.PhyMemMode:0"]


def test_vmm_description_is_read_in_two_chunks_across_a_comment(stub: QemuStub, gdb: GdbRemote) -> None:
    xfers = stub.sent(b"qXfer:features:read:")
    assert xfers == [
        b"qXfer:features:read:target.xml:0,f00",
        b"qXfer:features:read:i386-64bit.xml:0,f00",
        b"qXfer:features:read:i386-64bit.xml:%x,f00" % XML_SPLIT,
    ]
    assert "<!--" in I386_64BIT_XML[:XML_SPLIT] and "-->" in I386_64BIT_XML[XML_SPLIT:]


# Offsets and numbers stated independently of both the parser and the fake.
EXPECTED_REGS = [
    ("rax", 0, 0, 64),
    ("rbx", 1, 8, 64),
    ("rdi", 5, 40, 64),
    ("rsp", 7, 56, 64),
    ("r8", 8, 64, 64),
    ("r15", 15, 120, 64),
    ("rip", 16, 128, 64),
    ("eflags", 17, 136, 32),
    ("cs", 18, 140, 32),
    ("ss", 19, 144, 32),
    ("gs", 23, 160, 32),
    ("fs_base", 24, 164, 64),
    ("gs_base", 25, 172, 64),
    ("k_gs_base", 26, 180, 64),
    ("cr0", 27, 188, 64),
    ("cr2", 28, 196, 64),
    ("cr3", 29, 204, 64),
    ("cr4", 30, 212, 64),
    ("cr8", 31, 220, 64),
    ("efer", 32, 228, 64),
    ("st0", 33, 236, 80),
    ("st7", 40, 306, 80),
    ("fctrl", 41, 316, 32),
    ("fop", 48, 344, 32),
    ("xmm0", 49, 348, 128),
    ("xmm15", 64, 588, 128),
    ("mxcsr", 65, 604, 32),
]


@pytest.mark.parametrize(("name", "regnum", "offset", "bits"), EXPECTED_REGS)
def test_register_layout(gdb: GdbRemote, name: str, regnum: int, offset: int, bits: int) -> None:
    assert gdb.regs[name] == RegDesc(name, regnum, bits, offset)


def test_register_set_is_exactly_what_qemu_sends(gdb: GdbRemote) -> None:
    assert list(gdb.regs) == [n for n, _ in X86_64_REGS]
    for commented_out in ("cs_base", "ss_base", "ds_base", "es_base"):
        assert commented_out not in gdb.regs
    assert sum(d.size for d in gdb.regs.values()) == G_SIZE == 608
    assert gdb.regs["eflags"].size == 4
    assert gdb.regs["fs_base"].offset == gdb.regs["gs"].offset + 4


@pytest.mark.parametrize("xfer_max", [2045, 0x100, 0xF00])
def test_description_in_qemu_sized_chunks(xfer_max: int) -> None:
    stub = QemuStub(xfer_max=xfer_max)
    try:
        gdb = connect(stub)
        assert gdb.regs["rip"].offset == 128 and gdb.regs["cr3"].offset == 204
        n = len(stub.sent(b"qXfer:features:read:i386-64bit.xml"))
        assert n == -(-len(I386_64BIT_XML) // min(xfer_max, 0xF00))
    finally:
        stub.close()


def test_description_split_inside_a_reg_tag() -> None:
    split = I386_64BIT_XML.index('name="cr3"') + 4
    stub = QemuStub(xfer_splits={"i386-64bit.xml": [split]}, xfer_max=0xF00)
    try:
        assert connect(stub).regs["cr3"] == RegDesc("cr3", 29, 64, 204)
    finally:
        stub.close()


def handshake_refused(stub: QemuStub, pattern: str) -> None:
    """Connecting to ``stub`` fails with one line matching ``pattern``; the stub is closed either way."""
    try:
        with pytest.raises(ProtocolError, match=pattern) as info:
            connect(stub)
        one_line(info.value)
    finally:
        stub.close()


def test_the_description_s_architecture_is_reported(stub: QemuStub) -> None:
    assert connect(stub).architecture == "i386:x86-64"


def test_a_description_naming_no_architecture_reports_none() -> None:
    stub = QemuStub()
    stub.annexes["target.xml"] = stub.annexes["target.xml"].replace(b"<architecture>i386:x86-64</architecture>", b"")
    try:
        assert connect(stub).architecture == ""
    finally:
        stub.close()


@pytest.mark.parametrize("reply", [b"E00", b""])
def test_refused_description(reply: bytes) -> None:
    stub = QemuStub()
    stub.overrides[b"qXfer:features:read:target.xml"] = reply
    handshake_refused(stub, r"refused to send target\.xml")


def test_stub_without_qxfer_is_refused() -> None:
    stub = QemuStub(supported=b"PacketSize=1000;multiprocess+")
    handshake_refused(stub, "no target description")


def test_handshake_without_the_unsolicited_stop() -> None:
    stub = QemuStub(unsolicited_stop=False, packet_size=0x200)
    try:
        gdb = connect(stub)
        assert gdb.packet_size == 0x200
        assert gdb.chunk == (0x200 - 32) // 2
    finally:
        stub.close()


# -- threads and registers -------------------------------------------------------------


def test_threads(gdb: GdbRemote) -> None:
    assert gdb.threads() == ["p1.1", "p1.2"]


def test_threads_in_several_replies(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"qfThreadInfo"] = b"mp01.01"
    stub.overrides[b"qsThreadInfo"] = lambda p: b"mp01.02,p01.03" if len(stub.sent(b"qsThreadInfo")) == 1 else b"l"
    assert gdb.threads() == ["p1.1", "p1.2", "p1.3"]


@pytest.mark.parametrize("reply", [b"", b"E01", b"x"])
def test_bad_thread_list(stub: QemuStub, gdb: GdbRemote, reply: bytes) -> None:
    stub.overrides[b"qfThreadInfo"] = reply
    with pytest.raises(ProtocolError, match="bad thread list") as info:
        gdb.threads()
    one_line(info.value)


def test_read_registers(stub: QemuStub, gdb: GdbRemote) -> None:
    cpu = stub.vcpus[1]
    cpu.set("rip", 0xFFFF_FFFF_8123_4567)
    cpu.set("rdi", 0x1122_3344_5566_7788)
    cpu.set("eflags", 0x246)
    cpu.set("cs", 0x10)
    cpu.set("fs_base", 0x7F00_DEAD_0000)
    cpu.set("gs_base", 0xFFFF_8880_3FC0_0000)
    cpu.set("cr3", 0x0AB_C000 | 0x1005)
    cpu.set("efer", 0xD01)
    cpu.set("xmm0", (1 << 128) - 1)
    regs = gdb.read_registers("p1.2")
    assert stub.sent(b"Hg") == [b"Hgp1.2"]
    assert regs["rip"] == 0xFFFF_FFFF_8123_4567
    assert regs["rdi"] == 0x1122_3344_5566_7788
    assert regs["eflags"] == 0x246
    assert regs["cs"] == 0x10
    assert regs["fs_base"] == 0x7F00_DEAD_0000
    assert regs["gs_base"] == 0xFFFF_8880_3FC0_0000
    assert regs["cr3"] == 0x0AB_D005
    assert regs["efer"] == 0xD01
    # 80- and 128-bit registers are not integers a probe uses.
    assert "st0" not in regs and "xmm0" not in regs
    assert "mxcsr" in regs and "fop" in regs


def test_select_is_cached(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.read_registers("p1.1")
    gdb.read_registers("p1.1")
    gdb.read_registers("p1.2")
    gdb.read_registers("p1.2")
    assert stub.sent(b"Hg") == [b"Hgp1.1", b"Hgp1.2"]


def test_select_refused(gdb: GdbRemote) -> None:
    with pytest.raises(TargetError, match=r"refused selecting vCPU p1\.9: error E22") as info:
        gdb.read_registers("p1.9")
    one_line(info.value)


def test_a_short_register_packet_is_enough_without_needed_registers(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.vcpus[0].set("efer", 0xD01)
    stub.overrides[b"g"] = lambda p: bytes(stub.vcpus[0].regs[:236]).hex().encode()
    regs = gdb.read_registers("p1.1")
    assert regs["efer"] == 0xD01
    assert "fctrl" not in regs
    assert stub.sent(b"p") == []


def test_needed_registers_a_short_register_packet_lacks_are_read_with_p(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.needed = X86_64.registers.stop_registers
    stub.vcpus[0].set("cr3", 0x0AB_C000)
    stub.vcpus[0].set("cr4", 0x3506F0)
    stub.overrides[b"g"] = lambda p: bytes(stub.vcpus[0].regs[:200]).hex().encode()  # through cr0
    regs = gdb.read_registers("p1.1")
    assert (regs["cr3"], regs["cr4"]) == (0x0AB_C000, 0x3506F0)
    assert stub.sent(b"p") == [b"p1d", b"p1e"]  # cr3 and cr4: cr0 came, and efer is needed by no reader
    assert "efer" not in regs


def test_a_needed_register_that_does_not_come_is_named(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.needed = X86_64.registers.stop_registers
    stub.overrides[b"g"] = lambda p: bytes(stub.vcpus[0].regs[:200]).hex().encode()
    stub.overrides[b"p"] = b"E14"
    with pytest.raises(ProtocolError, match=r"^the gdbstub sent no cr3, cr4 for vCPU p1\.1 \(a 200-byte") as info:
        gdb.read_registers("p1.1")
    one_line(info.value)


# A feature QEMU describes but does not put in ``g`` (as aarch64's system registers): after the x86 core.
SYSREGS_XML = (
    '<?xml version="1.0"?><!DOCTYPE feature SYSTEM "gdb-target.dtd"><feature name="org.qemu.gdb.sysregs">'
    '<reg name="sp_el0" bitsize="64" type="int64"/><reg name="vbar" bitsize="64" type="int64"/></feature>'
)


def test_a_needed_register_outside_g_is_read_with_p_at_every_read() -> None:
    target = TARGET_XML.replace("</target>", '<xi:include href="sysregs.xml"/></target>')
    stub = QemuStub(annexes={"target.xml": target.encode(), "sysregs.xml": SYSREGS_XML.encode()})
    try:
        gdb = connect(stub)
        assert gdb.regs["sp_el0"].regnum == len(X86_64_REGS) == 0x42
        gdb.needed = frozenset(("rip", "cr3", "gs_base", "sp_el0"))
        for i, task in enumerate((0xFFFF_0000_0123_4000, 0xFFFF_0000_0567_8000)):
            stub.vcpus[0].outside_g[0x42] = task.to_bytes(8, "little")
            regs = gdb.read_registers("p1.1")
            assert regs["sp_el0"] == task and "vbar" not in regs  # only what is needed is read one by one
            assert stub.sent(b"p") == [b"p42"] * (i + 1)
        stub.vcpus[0].outside_g.clear()
        with pytest.raises(ProtocolError, match=r"^the gdbstub sent no sp_el0 for vCPU p1\.1"):
            gdb.read_registers("p1.1")
    finally:
        stub.close()
    assert not stub.errors, stub.errors


def test_register_packet_not_hex(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"g"] = b"E14"
    with pytest.raises(ProtocolError):
        gdb.read_registers("p1.1")


@pytest.mark.parametrize(
    ("name", "value", "packet"),
    [
        ("rip", 0xFFFF_FFFF_8100_0010, b"P10=10000081ffffffff"),
        ("rax", 1, b"P0=0100000000000000"),
        ("eflags", 0x1_0000_0246, b"P11=46020000"),  # 32 bits: masked
        ("rsp", -8, b"P7=f8ffffffffffffff"),  # negative: two's complement
        ("cr3", 0x1234000, b"P1d=0040230100000000"),
    ],
)
def test_write_register(stub: QemuStub, gdb: GdbRemote, name: str, value: int, packet: bytes) -> None:
    gdb.write_register("p1.2", name, value)
    assert stub.sent(b"P") == [packet]
    off, size = g_offsets()[name], dict(X86_64_REGS)[name] // 8
    mask = (1 << (8 * size)) - 1
    assert int.from_bytes(stub.vcpus[1].regs[off : off + size], "little") == value & mask
    assert gdb.read_registers("p1.2")[name] == value & mask


def test_write_registers_is_one_g_prefix(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.vcpus[0].set("cs", 0x10)
    stub.vcpus[0].set("cr3", 0x1234000)
    before = gdb.read_registers("p1.1")
    gdb.write_registers("p1.1", {"rip": KTEXT + 5, "rsp": 0xFFFF_C900_0000_3F00, "eflags": 0x1_0000_0202})
    # One G up to eflags (register 17), nothing past it; the registers read at this stop fill the gaps.
    (g,) = stub.sent(b"G")
    assert len(g) == 1 + 2 * (16 * 8 + 8 + 4) and not stub.sent(b"P")
    regs = gdb.read_registers("p1.1")
    assert (regs["rip"], regs["rsp"], regs["eflags"]) == (KTEXT + 5, 0xFFFF_C900_0000_3F00, 0x202)
    assert {k: v for k, v in regs.items() if k not in ("rip", "rsp", "eflags")} == \
        {k: v for k, v in before.items() if k not in ("rip", "rsp", "eflags")}  # fmt: skip


def test_two_registers_are_one_g_so_a_kill_cannot_split_them(stub: QemuStub, gdb: GdbRemote) -> None:
    # An emulated instruction's result and the ip past it: a client killed between two P packets would
    # leave the vCPU to run it again with its result already in place, or past it without the result.
    gdb.write_registers("p1.1", {"rax": 402, "rip": KTEXT + 4})
    assert len(stub.sent(b"G")) == 1 and not stub.sent(b"P")
    regs = gdb.read_registers("p1.1")
    assert (regs["rax"], regs["rip"]) == (402, KTEXT + 4)


def test_write_registers_reads_what_it_does_not_know(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.vcpus[1].set("rbx", 0x1234)
    gdb.write_registers("p1.2", {"rax": 1, "rcx": 2, "rdx": 3})
    assert stub.sent(b"g") and len(stub.sent(b"G")) == 1
    assert gdb.read_registers("p1.2")["rbx"] == 0x1234


def test_registers_are_not_remembered_across_a_resume(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.read_registers("p1.1")
    gdb.cont()
    stub.vcpus[0].set("rbx", 0x5678)  # the guest ran
    gdb.interrupt()
    gdb.wait_stop()
    gdb.write_registers("p1.1", {"rax": 1, "rcx": 2, "rdx": 3})
    assert gdb.read_registers("p1.1")["rbx"] == 0x5678


def test_without_allow_g_every_write_is_a_p(stub: QemuStub) -> None:
    gdb = connect(stub)
    gdb.write_registers("p1.1", {"rax": 1, "rcx": 2, "rdx": 3})
    assert len(stub.sent(b"P")) == 3 and not stub.sent(b"G")


def test_write_registers_beyond_the_general_ones_use_p(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.write_registers("p1.1", {"rip": KTEXT, "rsp": 8, "cr3": 0x1234000})
    assert len(stub.sent(b"P")) == 3 and not stub.sent(b"G")
    assert gdb.read_registers("p1.1")["cr3"] == 0x1234000


def test_write_register_refused(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"P"] = b"E22"
    with pytest.raises(TargetError, match="refused writing register rip: error E22") as info:
        gdb.write_register("p1.1", "rip", 0)
    one_line(info.value)


# -- memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("packet_size", [0x1000, 0x100, 0x47])
@pytest.mark.parametrize("size", [1, 2032, 2033, 5000, 3 * 2032])
def test_read_memory_is_chunked_within_packet_size(packet_size: int, size: int) -> None:
    stub = QemuStub(packet_size=packet_size)
    try:
        gdb = connect(stub)
        data = bytes((i * 7) & 0xFF for i in range(size))
        stub.fill(KTEXT, data)
        assert gdb.read_memory(KTEXT, size) == data
        reqs = stub.sent(b"m")
        lengths = [int(r.split(b",")[1], 16) for r in reqs]
        addrs = [int(r[1:].split(b",")[0], 16) for r in reqs]
        assert sum(lengths) == size
        assert addrs == [KTEXT + sum(lengths[:i]) for i in range(len(lengths))]
        # The reply ($, hex, #, checksum) fits the stub's PacketSize.
        assert max(lengths) * 2 + 4 <= packet_size
        assert len(reqs) == -(-size // ((packet_size - 32) // 2))
    finally:
        stub.close()
    assert not stub.errors


@pytest.mark.parametrize("packet_size", [0x1000, 0x100])
def test_write_memory_is_chunked_within_packet_size(packet_size: int) -> None:
    stub = QemuStub(packet_size=packet_size)
    try:
        gdb = connect(stub)
        stub.fill(KTEXT, bytes(6000))
        data = bytes(range(256)) * 23 + b"#$}*"
        gdb.write_memory(KTEXT + 3, data)
        assert stub.read(KTEXT + 3, len(data)) == data
        frames = [f for f in stub.frames if f.startswith(b"$M")]
        assert len(frames) == -(-len(data) // gdb.chunk)
        assert max(len(f) for f in frames) <= packet_size
    finally:
        stub.close()
    assert not stub.errors


def test_write_nothing_sends_nothing(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.write_memory(KTEXT, b"")
    assert stub.sent(b"M") == []


def test_read_memory_error_reply(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.fill(KTEXT, bytes(3000))  # the second chunk starts past the end
    with pytest.raises(TargetError, match=r"cannot read guest memory at 0xffffffff810007f0: error E14") as info:
        gdb.read_memory(KTEXT, 4000)
    assert not isinstance(info.value, TargetGone)
    one_line(info.value)


def test_write_memory_error_reply(stub: QemuStub, gdb: GdbRemote) -> None:
    with pytest.raises(TargetError, match=r"refused writing guest memory at 0x1000: error E14") as info:
        gdb.write_memory(0x1000, b"\xcc")
    one_line(info.value)


def test_read_memory_unsupported_is_an_error_not_a_hang(stub: QemuStub, gdb: GdbRemote) -> None:
    # An empty reply adds no bytes, so the loop re-sends the same 'm' forever.
    # The stub gives up after 20 of them, which turns the hang into TargetGone.
    stub.overrides[b"m"] = lambda p: CLOSE if len(stub.sent(b"m")) > 20 else b""
    with pytest.raises(TargetError) as info:
        gdb.read_memory(KTEXT, 16)
    assert not isinstance(info.value, TargetGone)
    assert len(stub.sent(b"m")) == 1
    one_line(info.value)


def test_set_physical_is_sent_once(stub: QemuStub, gdb: GdbRemote) -> None:
    connected = len(stub.sent(b"Qqemu.PhyMemMode"))
    gdb.set_physical(True)
    gdb.set_physical(True)
    assert stub.phys_mode
    gdb.set_physical(False)
    assert stub.sent(b"Qqemu.PhyMemMode")[connected:] == [b"Qqemu.PhyMemMode:1", b"Qqemu.PhyMemMode:0"]
    assert not stub.phys_mode


def test_a_connect_leaves_no_physical_mode_of_a_killed_client(stub: QemuStub) -> None:
    stub.phys_mode = True  # the stub's one flag, as a client killed in physical mode left it
    connect(stub)
    assert not stub.phys_mode


def test_set_physical_unsupported(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"Qqemu.PhyMemMode"] = b""
    with pytest.raises(TargetError, match="physical memory mode: empty reply") as info:
        gdb.set_physical(True)
    one_line(info.value)


# -- breakpoints ------------------------------------------------------------------------


def test_breakpoints(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.insert_breakpoint(KTEXT + 0x10)
    gdb.remove_breakpoint(KTEXT + 0x10, BREAK_SW, 1)
    assert stub.sent(b"Z") + stub.sent(b"z") == [b"Z0,ffffffff81000010,1", b"z0,ffffffff81000010,1"]


@pytest.mark.parametrize(("kind", "reply", "words"), [
    (BREAK_HW, b"", "breakpoint at 0xffffffff81000000: empty reply (not supported)"),
    (WATCH_ACCESS, b"E22", "breakpoint at 0xffffffff81000000: error E22"),
])  # fmt: skip
def test_breakpoint_refused(stub: QemuStub, gdb: GdbRemote, kind: int, reply: bytes, words: str) -> None:
    stub.overrides[b"Z%d" % kind] = reply
    with pytest.raises(TargetError, match=re.escape(words)) as info:
        gdb.insert_breakpoint(KTEXT, kind)
    one_line(info.value)


# -- execution ----------------------------------------------------------------------------


def test_step(stub: QemuStub, gdb: GdbRemote) -> None:
    before = gdb.read_registers("p1.2")["rip"]
    stop = gdb.step("p1.2", timeout=2.0)
    assert stop.thread == "p1.2" and stop.signal == 5
    assert stub.sent(b"vCont") == [b"vCont;s:p1.2"]
    assert gdb.running is False
    assert gdb.read_registers("p1.2")["rip"] == before + 1


def test_cont_interrupt_and_wait(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.cont()
    assert gdb.running
    assert wait_for(lambda: stub.running)
    with pytest.raises(TargetError, match="internal: request") as info:
        gdb.read_registers("p1.1")
    one_line(info.value)
    assert gdb.poll_stop(0.1) is None and gdb.running
    gdb.interrupt()
    stop = gdb.wait_stop(2.0)
    assert (stop.signal, stop.thread, gdb.running) == (2, "p1.1", False)
    assert stub.interrupts == 1


def test_poll_stop_sees_a_breakpoint_hit(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.cont()
    assert wait_for(lambda: stub.running)
    stub.send(pkt(b"T05thread:p01.02;swbreak:;"))
    stop = gdb.poll_stop(2.0)
    assert stop is not None and stop.thread == "p1.2" and stop.field("swbreak") == ""
    assert gdb.running is False


def test_poll_stop_ends_when_woken_and_a_stop_that_came_wins(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.cont()
    assert wait_for(lambda: stub.running)
    r, w = os.pipe()
    try:
        os.write(w, b"\0")
        # Unbounded but for the wake-up: it ends only because the pipe is readable.
        assert gdb.poll_stop(float("inf"), r) is None and gdb.running
        stub.send(pkt(b"T05thread:p01.02;swbreak:;"))
        assert wait_for(lambda: select.select([gdb.conn.sock], [], [], 0)[0])
        stop = gdb.poll_stop(float("inf"), r)  # the pipe is still readable: the stop is read first
        assert stop is not None and stop.thread == "p1.2" and gdb.running is False
    finally:
        os.close(r)
        os.close(w)


def test_wait_stop_timeout(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.cont()
    with pytest.raises(GuestTimeout):
        gdb.wait_stop(0.2)


def test_detach_closes_the_connection(stub: QemuStub, gdb: GdbRemote) -> None:
    gdb.detach()
    assert stub.requests[-1] == b"D;1"
    with pytest.raises(TargetGone):
        gdb.request(b"?")


def test_peer_that_closes_mid_request_is_target_gone(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"m"] = CLOSE
    with pytest.raises(TargetGone) as info:
        gdb.read_memory(KTEXT, 8)
    one_line(info.value)


def test_silent_stub_is_guest_timeout(stub: QemuStub, gdb: GdbRemote) -> None:
    stub.overrides[b"g"] = SILENT
    gdb.select("p1.1")
    # GdbRemote's own requests wait 10 s; the connection's timeout is what is under test.
    with pytest.raises(GuestTimeout):
        gdb.conn.request(b"g", timeout=0.2)


def test_registers_after_a_stop_on_another_vcpu(stub: QemuStub, gdb: GdbRemote) -> None:
    # QEMU makes the vCPU that stopped the Hg one again at every stop
    # (gdb_set_stop_cpu), so a cached "p1.2 is selected" is stale after any
    # resume: the next 'g' for p1.2 would return p1.1's registers.
    stub.vcpus[0].set("rip", KTEXT + 0x111)
    stub.vcpus[1].set("rip", KTEXT + 0x222)
    assert gdb.read_registers("p1.2")["rip"] == KTEXT + 0x222
    gdb.cont()
    assert wait_for(lambda: stub.running)
    gdb.interrupt()
    assert gdb.wait_stop(2.0).thread == "p1.1"
    assert gdb.read_registers("p1.2")["rip"] == KTEXT + 0x222


def test_fake_matches_the_literal_description() -> None:
    assert 'href="i386-64bit.xml"' in TARGET_XML


def test_stale_breakpoints_are_dropped_on_every_vcpu_then_vcpu_0_is_selected_again() -> None:
    """A connect's '?' cleans the vCPU selected for 'c' only: each other one is selected and asked in turn."""
    sent: list[bytes] = []

    def request(payload: bytes) -> bytes:
        sent.append(payload)
        return b"T05thread:p01.01;" if payload == b"?" else b"OK"

    drop_stale_breakpoints(request, ["p1.1", "p1.2", "p1.3"])
    assert sent == [b"Hcp1.2", b"?", b"Hcp1.3", b"?", b"Hcp1.1"]
    sent.clear()
    drop_stale_breakpoints(request, ["p1.1"])  # one vCPU: the connect's own '?' did it
    assert sent == []
    with pytest.raises(TargetError, match=r"selecting vCPU p1\.2"):
        drop_stale_breakpoints(lambda _p: b"E22", ["p1.1", "p1.2"])
