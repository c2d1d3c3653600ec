"""The gdb/MI transport's parsing, from raw MI lines as gdb 13 printed them against QEMU 7.2.

pygdbmi turns each line into a dict; these tables check what qprobe makes of
those dicts (qprobe.vmm.gdbmi_parse), and that anything
unexpected is refused rather than guessed at.  The last tests drive a real gdb
process (no VM) to check the token matching of MiChannel.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from pygdbmi.gdbmiparser import parse_response

from qprobe.errors import ProtocolError, TargetError, TargetGone
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.gdbmi_channel import MiChannel
from qprobe.vmm.gdbmi_parse import (
    GDB_SIGNALS,
    gdb_address,
    mi_quote,
    parse_architecture,
    parse_breakpoint_number,
    parse_breakpoint_type,
    parse_maint_packet,
    parse_memory,
    parse_register_values,
    parse_remote_registers,
    parse_stopped,
    parse_target_id,
    parse_thread_info,
    result_payload,
    stream_text,
)
from qprobe.vmm.rsp import StopReply, parse_stop_reply
from qprobe.vmm.tdesc import RegDesc


def mi(line: str) -> dict[str, Any]:
    """One MI line as pygdbmi parses it."""
    return parse_response(line)


def payload(line: str) -> dict[str, Any]:
    return mi(line)["payload"]


# -- quoting ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("info registers rip", '"info registers rip"'),
        ('print "a"', '"print \\"a\\""'),
        ("a\\b", '"a\\\\b"'),
        ("x\ny\tz", '"x\\ny\\tz"'),
        ("", '""'),
    ],
)
def test_mi_quote(text: str, quoted: str) -> None:
    assert mi_quote(text) == quoted


@pytest.mark.parametrize("text", ["\x03", "caf\u00e9", "\x7f", "a\rb"])
def test_mi_quote_refuses_what_mi_cannot_carry(text: str) -> None:
    with pytest.raises(TargetError, match="printable ASCII"):
        mi_quote(text)


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("unix:/tmp/qprobe-run-x/gdb.sock", "/tmp/qprobe-run-x/gdb.sock"),
        ("/tmp/qprobe-run-x/gdb.sock", "/tmp/qprobe-run-x/gdb.sock"),
        ("127.0.0.1:1234", "127.0.0.1:1234"),
    ],
)
def test_gdb_address(address: str, target: str) -> None:
    assert gdb_address(address) == target


@pytest.mark.parametrize("address", ["unix:", "unix:/tmp/a b/gdb.sock", ""])
def test_gdb_address_refuses(address: str) -> None:
    with pytest.raises(TargetError, match="bad gdbstub address"):
        gdb_address(address)


# -- results --------------------------------------------------------------------------------
def test_result_payload_done_running_connected() -> None:
    assert result_payload(mi("1^done"), "x") == {}
    assert result_payload(mi("8^running"), "x") == {}
    assert result_payload(mi("5^connected"), "x") == {}
    assert result_payload(mi('9^done,new-thread-id="2"'), "x") == {"new-thread-id": "2"}


def test_result_payload_error_is_one_line() -> None:
    line = '16^error,msg="Cannot execute this command while the target is running.\\nUse the \\"interrupt\\" command"'
    with pytest.raises(TargetError, match="gdb refused -thread-info: Cannot execute") as e:
        result_payload(mi(line), "-thread-info")
    assert "\n" not in str(e.value)
    assert not isinstance(e.value, ProtocolError)


def test_result_payload_refuses_an_unknown_result_class() -> None:
    with pytest.raises(ProtocolError, match="unexpected gdb result"):
        result_payload(mi("3^whatever"), "x")


# -- threads ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target_id", "tid"),
    [("Thread 1.1", "p1.1"), ("Thread 1.2", "p1.2"), ("Thread 1.16", "p1.10"), ("Thread 3", "p1.3"),
     ("Thread 2.10", "p2.a")],
)  # fmt: skip
def test_parse_target_id(target_id: str, tid: str) -> None:
    assert parse_target_id(target_id) == tid


@pytest.mark.parametrize("target_id", ["process 1", "Thread 1.2 (CPU#1)", "Thread", "Thread 0x1.2", "LWP 5"])
def test_parse_target_id_refuses(target_id: str) -> None:
    with pytest.raises(ProtocolError, match="names a thread"):
        parse_target_id(target_id)


THREAD_INFO = (
    '6^done,threads=[{id="1",target-id="Thread 1.1",details="CPU#0 [halted ]",frame={level="0",'
    'addr="0xffffffffba217a0b",func="??",args=[],arch="i386:x86-64"},state="stopped"},{id="2",'
    'target-id="Thread 1.2",details="CPU#1 [halted ]",frame={level="0",addr="0xffffffffba217a0b",'
    'func="??",args=[],arch="i386:x86-64"},state="stopped"}],current-thread-id="1"'
)


def test_parse_thread_info() -> None:
    assert parse_thread_info(payload(THREAD_INFO)) == [("1", "p1.1"), ("2", "p1.2")]
    assert parse_thread_info(payload("19^done,threads=[]")) == []


def test_parse_thread_info_refuses_duplicates_and_missing_fields() -> None:
    with pytest.raises(ProtocolError, match="twice"):
        parse_thread_info(payload('1^done,threads=[{id="1",target-id="Thread 1.1"},{id="2",target-id="Thread 1.1"}]'))
    with pytest.raises(ProtocolError, match="no 'target-id'"):
        parse_thread_info(payload('1^done,threads=[{id="1"}]'))
    with pytest.raises(ProtocolError, match="no 'threads'"):
        parse_thread_info(payload('1^done,thread-ids={thread-id="1"}'))


# -- registers --------------------------------------------------------------------------------
# ``maint print remote-registers`` as gdb 13 printed it for QEMU 7.2's x86_64 description (abridged).
REMOTE_REGISTERS = """\
 Name         Nr  Rel Offset    Size  Type            Rmt Nr  g/G Offset
 rax           0    0      0       8 int64_t               0           0
 rbx           1    1      8       8 int64_t               1           8
 rsp           7    7     56       8 *1                    7          56
 rip          16   16    128       8 *1                   16         128
 eflags       17   17    136       4 x64_eflags           17         136
 cs           18   18    140       4 int32_t              18         140
 st0          24   24    164      10 _i387_ext            33         236
 fop          39   39    272       4 int                  48         344
 ''           40   40    276       0 int0_t          
 fs_base     155  155    276       8 int64_t              24         164
 gs_base     156  156    284       8 int64_t              25         172
 cr3         160  160    316       8 x64_cr3              29         204
 efer        163  163    340       8 x64_efer             32         228
 xmm0        164  164    348      16 vec128               49         348
 mxcsr       180  180    604       4 x64_mxcsr            65         604
 al          181    0    608       1 int8_t          
 ''          208   27    642       2 int16_t         
 eax         217   36    660       4 int32_t         
*1: Register type's name NULL.
"""  # noqa: W291 - gdb pads the pseudo-register rows


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('The target architecture is set to "auto" (currently "i386:x86-64").', "i386:x86-64"),
        ('The target architecture is set to "aarch64".', "aarch64"),
        ('The target architecture is set to "auto" (currently "auto").', ""),
        ("", ""),
    ],
)
def test_parse_architecture(text: str, name: str) -> None:
    assert parse_architecture(text) == name


def test_parse_remote_registers() -> None:
    regs, numbers = parse_remote_registers(REMOTE_REGISTERS)
    assert regs["rax"] == RegDesc("rax", 0, 64, 0)
    assert regs["eflags"] == RegDesc("eflags", 17, 32, 136)
    assert regs["fs_base"] == RegDesc("fs_base", 24, 64, 164)  # remote numbering, as GdbRemote.regs
    assert regs["efer"] == RegDesc("efer", 32, 64, 228)
    assert regs["st0"] == RegDesc("st0", 33, 80, 236)
    assert regs["xmm0"].bitsize == 128
    assert numbers["fs_base"] == 155 and numbers["rip"] == 16 and numbers["mxcsr"] == 180  # gdb numbering
    assert "al" not in regs and "eax" not in regs and "''" not in regs  # pseudo registers and gaps
    assert list(regs) == list(numbers)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "unexpected header"),
        (" Nr Name\n", "unexpected header"),
        (REMOTE_REGISTERS.replace(" cs           18", " cs           x8"), "cannot parse"),
        (REMOTE_REGISTERS + " rax           0    0      0       8 int64_t               0           0\n", "twice"),
    ],
)
def test_parse_remote_registers_refuses(text: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_remote_registers(text)


REGISTER_VALUES = (
    '8^done,register-values=[{number="0",value="0x1ad40"},{number="16",value="0xffffffffba217a0b"},'
    '{number="17",value="0x246"},{number="155",value="0x0"},{number="156",value="0xff2fc7a45f200000"}]'
)
NAMES = {0: "rax", 16: "rip", 17: "eflags", 155: "fs_base", 156: "gs_base"}


def test_parse_register_values() -> None:
    assert parse_register_values(payload(REGISTER_VALUES), NAMES) == {
        "rax": 0x1AD40, "rip": 0xFFFFFFFFBA217A0B, "eflags": 0x246, "fs_base": 0, "gs_base": 0xFF2FC7A45F200000,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (REGISTER_VALUES.replace('{number="17",value="0x246"},', ""), r"did not send registers \['eflags'\]"),
        (REGISTER_VALUES.replace('number="17"', 'number="18"'), "not asked for"),
        (REGISTER_VALUES.replace('value="0x246"', 'value="<unavailable>"'), "expected a number"),
        (REGISTER_VALUES.replace('value="0x246"', 'value=["0x246"]'), "expected a string"),
        ("8^done,register-names=[]", "no 'register-values'"),
    ],
)
def test_parse_register_values_refuses(line: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_register_values(payload(line), NAMES)


# -- memory ----------------------------------------------------------------------------------------
MEMORY = (
    '12^done,memory=[{begin="0x0000000000001000",offset="0x0000000000000000",end="0x0000000000001010",'
    'contents="000102030405060708090a0b0c0d0eff"}]'
)

# A range gdb could read only in part: it answers with the readable blocks.
TWO_BLOCKS = MEMORY.replace("}]", '},{begin="0x1010",offset="0x0",end="0x1011",contents="00"}]')


def test_parse_memory() -> None:
    assert parse_memory(payload(MEMORY), 0x1000, 16) == bytes(range(15)) + b"\xff"


@pytest.mark.parametrize(
    ("line", "addr", "size", "error", "match"),
    [
        (MEMORY, 0x1000, 17, TargetError, r"read 0x1000\.\.0x1010 only"),
        (MEMORY, 0x1001, 15, TargetError, "read 0x1000"),
        (TWO_BLOCKS, 0x1000, 17, TargetError, "only part"),
        ("1^done,memory=[]", 0x1000, 16, TargetError, "only part"),
        (MEMORY.replace("0eff", "0eZZ"), 0x1000, 16, ProtocolError, "not hex"),
        (MEMORY.replace("0eff", "0e"), 0x1000, 16, ProtocolError, "15 bytes"),
    ],
)
def test_parse_memory_refuses(line: str, addr: int, size: int, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_memory(payload(line), addr, size)


# -- breakpoints -------------------------------------------------------------------------------------
def test_parse_breakpoint_number() -> None:
    line = (
        '11^done,bkpt={number="1",type="breakpoint",disp="keep",enabled="y",addr="0xffffffff81000000",'
        'thread-groups=["i1"],times="0",original-location="*0xffffffff81000000"}'
    )
    assert parse_breakpoint_number(payload(line)) == "1"
    assert parse_breakpoint_number(payload('4^done,wpt={number="2",exp="*(unsigned char (*)[8]) 0x1000"}')) == "2"
    assert parse_breakpoint_number(payload('4^done,hw-rwpt={number="3",exp="x"}')) == "3"
    assert parse_breakpoint_number(payload('4^done,hw-awpt={number="4",exp="x"}')) == "4"
    with pytest.raises(ProtocolError, match="numbered"):
        parse_breakpoint_number(payload('1^done,bkpt={number="1.2"}'))
    with pytest.raises(ProtocolError, match="no single breakpoint"):
        parse_breakpoint_number(payload('1^done,tracepoint={number="1"}'))
    with pytest.raises(ProtocolError, match="no single breakpoint"):
        parse_breakpoint_number(payload('1^done,bkpt={number="1"},wpt={number="2"}'))


BREAK_INFO = (
    '5^done,BreakpointTable={nr_rows="1",nr_cols="6",hdr=[{width="7",alignment="-1",col_name="number",'
    'colhdr="Num"}],body=[bkpt={number="2",type="hw watchpoint",disp="keep",enabled="y",addr="",'
    'what="*(unsigned char (*)[8]) 0x1000",times="0"}]}'
)


def test_parse_breakpoint_type() -> None:
    assert parse_breakpoint_type(payload(BREAK_INFO)) == "hw watchpoint"
    assert parse_breakpoint_type(payload(BREAK_INFO.replace("hw watchpoint", "watchpoint"))) == "watchpoint"
    with pytest.raises(ProtocolError, match="lists 0 breakpoints"):
        parse_breakpoint_type(payload('5^done,BreakpointTable={nr_rows="0",body=[]}'))


# -- stops ---------------------------------------------------------------------------------------------
THREADS = {"1": "p1.1", "2": "p1.2"}


@pytest.mark.parametrize(
    ("line", "kind", "signal", "thread", "raw"),
    [
        # What `target remote` reports on connecting (QEMU's '?' answers T05).
        ('*stopped,frame={addr="0xffffffff91417a0b",func="??",args=[],arch="i386:x86-64"},thread-id="1",'
         'stopped-threads="all"', "T", 5, "p1.1", b"T05thread:p01.01;"),
        ('*stopped,reason="breakpoint-hit",disp="keep",bkptno="1",frame={addr="0xffffffff81a00b40",func="??",'
         'args=[],arch="i386:x86-64"},thread-id="2",stopped-threads="all",core="1"', "T", 5, "p1.2",
         b"T05thread:p01.02;"),
        ('*stopped,reason="end-stepping-range",frame={addr="0xffffffffb983c09d",func="??",args=[],'
         'arch="i386:x86-64"},thread-id="2",stopped-threads="all"', "T", 5, "p1.2", b"T05thread:p01.02;"),
        ('*stopped,reason="signal-received",signal-name="SIGINT",signal-meaning="Interrupt",frame={addr='
         '"0xffffffffb9c17a0b",func="??",args=[],arch="i386:x86-64"},thread-id="1",stopped-threads="all"',
         "T", 2, "p1.1", b"T02thread:p01.01;"),
        ('*stopped,reason="signal-received",signal-name="SIGSEGV",signal-meaning="Segmentation fault",'
         'thread-id="1",stopped-threads="all"', "T", 11, "p1.1", b"T0bthread:p01.01;"),
        ('*stopped,reason="exited-normally"', "W", 0, None, b"W00"),
        ('*stopped,reason="exited",exit-code="012"', "W", 10, None, b"W0a"),
        ('*stopped,reason="exited-signalled",signal-name="SIGKILL",signal-meaning="Killed"', "X", 9, None, b"X09"),
    ],
)  # fmt: skip
def test_parse_stopped(line: str, kind: str, signal: int, thread: str | None, raw: bytes) -> None:
    stop = parse_stopped(payload(line), THREADS)
    assert (stop.kind, stop.signal, stop.thread) == (kind, signal, thread)
    wire = parse_stop_reply(raw)  # what the RSP transport would have handed the stop loop
    assert (stop.kind, stop.signal, stop.thread, stop.exited) == (wire.kind, wire.signal, wire.thread, wire.exited)


def test_parse_stopped_keeps_gdbs_explanation() -> None:
    line = ('*stopped,reason="breakpoint-hit",disp="keep",bkptno="3",frame={addr="0xffffffff81a00b40"},'
            'thread-id="2",stopped-threads="all"')  # fmt: skip
    stop = parse_stopped(payload(line), THREADS)
    assert stop == StopReply("T", 5, "p1.2", (("reason", "breakpoint-hit"), ("bkptno", "3"), ("thread", "p1.2"),
                                              ("addr", "0xffffffff81a00b40")))  # fmt: skip
    assert stop.field("bkptno") == "3"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('*stopped,reason="watchpoint-trigger",wpt={number="2",exp="*(unsigned char (*)[8]) 0xffffffff82e1c0c8"},'
         'value={old="{0, 0}",new="{1, 0}"},frame={addr="0xffffffff810b52e0"},thread-id="1",stopped-threads="all"',
         ("watch", "ffffffff82e1c0c8")),
        ('*stopped,reason="read-watchpoint-trigger",hw-rwpt={number="3",exp="x"},value={value="1"},thread-id="2"',
         ("rwatch", "1000")),
        ('*stopped,reason="access-watchpoint-trigger",hw-awpt={number="4",exp="x"},value={new="1"},thread-id="2"',
         ("awatch", "2000")),
    ],
)  # fmt: skip
def test_parse_stopped_watchpoints_name_the_watched_address_as_qemu_does(line: str, field: tuple[str, str]) -> None:
    watches = {"2": 0xFFFFFFFF82E1C0C8, "3": 0x1000, "4": 0x2000}
    stop = parse_stopped(payload(line), THREADS, watches)
    assert (stop.kind, stop.signal) == ("T", 5)
    assert stop.field(field[0]) == field[1]
    assert stop.thread is not None
    raw = f"T05thread:p01.0{stop.thread[-1]};{field[0]}:{field[1]};"  # what QEMU sends for the same hit
    wire = parse_stop_reply(raw.encode())
    assert wire.field(field[0]) == stop.field(field[0]) and wire.thread == stop.thread


def test_parse_stopped_watchpoint_of_gdbs_own_has_no_address() -> None:
    line = '*stopped,reason="watchpoint-trigger",wpt={number="9",exp="x"},thread-id="1"'
    stop = parse_stopped(payload(line), THREADS, {"2": 0x1000})
    assert stop.field("watch") is None and stop.signal == 5
    with pytest.raises(ProtocolError, match="no 'wpt'"):
        parse_stopped(payload('*stopped,reason="watchpoint-trigger",thread-id="1"'), THREADS, {})


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('*stopped,reason="breakpoint-hit",thread-id="3"', "never listed"),
        ('*stopped,reason="fork",thread-id="1"', "does not know"),
        ('*stopped,reason="signal-received",signal-name="SIGFOO",thread-id="1"', "SIGFOO"),
        ('*stopped,reason="signal-received",thread-id="1"', "no 'signal-name'"),
        ('*stopped,reason="exited",exit-code="9"', "exit code"),
        ('*stopped,reason=["breakpoint-hit"]', "expected a string"),
    ],
)
def test_parse_stopped_refuses(line: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_stopped(payload(line), THREADS)


def test_gdb_signal_numbers_are_the_remote_protocols() -> None:
    # gdb's numbering, not Linux's: SIGSTOP is 17 on the wire, 19 on x86 Linux.
    assert (GDB_SIGNALS["SIGINT"], GDB_SIGNALS["SIGTRAP"], GDB_SIGNALS["SIGSTOP"], GDB_SIGNALS["SIGUSR1"]) == (
        2, 5, 17, 30,
    )  # fmt: skip
    assert len(set(GDB_SIGNALS.values())) == len(GDB_SIGNALS)


# -- maint packet ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "reply"),
    [
        ('sending: Qqemu.PhyMemMode:1\nreceived: "OK"\n', b"OK"),
        ('sending: qC\nreceived: "QCp01.01"\n', b"QCp01.01"),
        ('sending: qfoo\nreceived: ""\n', b""),
        ('sending: m0,4\nreceived: "a\\x00b\\\\c\\"d"\n', b'a\x00b\\c"d'),
        ('sending: qAttached\nreceived: "1"', b"1"),
    ],
)
def test_parse_maint_packet(text: str, reply: bytes) -> None:
    assert parse_maint_packet(text) == reply


@pytest.mark.parametrize(
    "text",
    ["sending: g\n", 'received: "OK"\nreceived: "OK"\n', 'received: "OK\n', 'received: "a\\xZZ"\n', "received: OK\n"],
)
def test_parse_maint_packet_refuses(text: str) -> None:
    with pytest.raises(ProtocolError):
        parse_maint_packet(text)


def test_stream_text_keeps_console_target_and_raw_output_only() -> None:
    records = [
        mi('~"rip            0xffffffff8f417a0b  0xffffffff8f417a0b\\n"'),
        mi('&"warning: No executable has been specified\\n"'),
        mi('=cmd-param-changed,param="architecture",value="i386:x86-64"'),
        mi('@"guest says hi\\n"'),
        mi("plain text a shell command printed"),
        mi("20^done"),
    ]
    assert stream_text(records) == (
        "rip            0xffffffff8f417a0b  0xffffffff8f417a0b\nguest says hi\nplain text a shell command printed"
    )


# -- MiChannel against a real gdb (no VM) -------------------------------------------------------------
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (Debian package gdb)")


@needs_gdb
def test_channel_matches_results_by_token_not_by_timing() -> None:
    ch = MiChannel()
    try:
        # Pipelined: all three are written before any answer is read.
        tokens = [ch.send("-gdb-set width 0"), ch.send("-this-is-no-command"), ch.send("-list-features")]
        third = ch.result(tokens[2], "features")
        second = ch.result(tokens[1], "bad")
        first = ch.result(tokens[0], "width")
        assert first["message"] == "done" and second["message"] == "error" and third["message"] == "done"
        assert "features" in result_payload(third, "features")
        with pytest.raises(TargetError, match="gdb refused -this-is-no-command"):
            result_payload(second, "-this-is-no-command")
        ch.result(ch.send('-interpreter-exec console "echo hello\\\\n"'), "echo")
        assert ch.console_text() == "hello\n"
    finally:
        ch.close()
    ch.close()  # idempotent


@needs_gdb
def test_channel_reports_a_dead_gdb_promptly() -> None:
    ch = MiChannel(name="test")
    try:
        ch.proc.kill()
        ch.proc.wait()
        with pytest.raises(TargetGone, match="lost the gdbstub connection test") as e:
            ch.command("-list-features", timeout=5)
        assert "\n" not in str(e.value)
    finally:
        ch.close()


@needs_gdb
def test_channel_reports_a_dead_qemu_while_waiting() -> None:
    ch = MiChannel(alive=lambda: False)
    try:
        with pytest.raises(TargetGone, match="QEMU exited"):
            ch.next_stop(5.0)
    finally:
        ch.close()


@needs_gdb
@pytest.mark.parametrize("address", ["127.0.0.1:1", "unix:/nonexistent/qprobe-gdb.sock"])
def test_no_stub_is_target_gone_in_one_line(address: str) -> None:
    remote = GdbMiRemote(address, connect_timeout=1)
    try:
        # What bounds the wait is gdb's own retry period for a refused connection, not its default 15 s;
        # a gdb that never gave up would end in GuestTimeout from handshake's own deadline, not TargetGone.
        assert remote.conn.command("-gdb-show tcp connect-timeout") == {"value": "1"}
        with pytest.raises(TargetGone, match="cannot connect to the gdbstub at") as e:
            remote.handshake()
    finally:
        remote.conn.close()
    assert "\n" not in str(e.value)
