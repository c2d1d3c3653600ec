"""GDB remote protocol framing: checksums, escapes, run-length encoding, the incremental parser, stop replies."""

from __future__ import annotations

import random
from typing import Any, SupportsIndex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vmm_fakes import csum, esc, pkt

from qprobe.errors import ProtocolError, TargetError
from qprobe.vmm.rsp import (
    MAX_PACKET,
    Ack,
    Event,
    Nak,
    Notification,
    Packet,
    PacketParser,
    StopReply,
    checksum,
    decode_body,
    escape,
    frame,
    hex_to_bytes,
    normalize_thread,
    parse_stop_reply,
)

# -- checksum / escape / frame ---------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", 0x00),
        (b"OK", 0x9A),
        (b"E14", 0xAA),
        (b"l", 0x6C),
        (b"?", 0x3F),
        (b"\xff\xff", 0xFE),  # modulo 256
        (b"g", 0x67),
    ],
)
def test_checksum(data: bytes, expected: int) -> None:
    assert checksum(data) == expected
    assert csum(data) == b"%02x" % expected


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        (b"abc", b"abc"),
        (b"#", b"}\x03"),
        (b"$", b"}\x04"),
        (b"}", b"}]"),
        (b"*", b"}\x0a"),
        (b"a#b$c}d*e", b"a}\x03b}\x04c}]d}\x0ae"),
        (b"\x00\x7f\x80\xff", b"\x00\x7f\x80\xff"),
    ],
)
def test_escape_table(raw: bytes, escaped: bytes) -> None:
    assert escape(raw) == escaped
    assert decode_body(escaped) == raw


@pytest.mark.parametrize(
    ("payload", "framed"),
    [
        (b"OK", b"$OK#9a"),
        (b"", b"$#00"),
        (b"g", b"$g#67"),
        (b"?", b"$?#3f"),
        # The checksum covers the escaped body, as sent.
        (b"}", b"$}]#da"),
        (b"qSupported:multiprocess+", pkt(b"qSupported:multiprocess+")),
    ],
)
def test_frame_table(payload: bytes, framed: bytes) -> None:
    assert frame(payload) == framed
    assert PacketParser().feed(framed) == [Packet(payload)]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_escape_and_frame_round_trip(payload: bytes) -> None:
    assert decode_body(escape(payload)) == payload
    assert not set(escape(payload)) & set(b"#$")
    assert frame(payload) == pkt(payload)
    assert PacketParser().feed(frame(payload)) == [Packet(payload)]


@pytest.mark.parametrize(
    ("body", "decoded"),
    [
        (b"0* ", b"0000"),  # ' ' = 29 + 3: three more
        (b"0*!", b"00000"),
        (b'ff*"00', b"ff" + b"f" * 5 + b"00"),
        (b"0*~", b"0" * 98),  # '~' = 126: the largest count
        (b"a* b* ", b"aaaabbbb"),
        (b"0* * ", b"0" * 7),  # a second run repeats the expanded byte
        (b"}]* ", b"}}}}"),  # a run repeats the unescaped byte
    ],
)
def test_run_length_decoding(body: bytes, decoded: bytes) -> None:
    assert decode_body(body) == decoded
    assert PacketParser().feed(pkt(body, raw=True)) == [Packet(decoded)]


# -- the parser on recorded QEMU 7.2 streams ------------------------------------------

REGS_RLE = b"0000000000000000" * 2 + b"0*<" + b"10f0ffffffff"  # '<' = 60: 31 more zeros

STREAMS: list[tuple[str, bytes, list[Event]]] = [
    ("stop-reply", b"+" + pkt(b"T05thread:p01.02;swbreak:;"), [Ack(), Packet(b"T05thread:p01.02;swbreak:;")]),
    ("ok", b"+$OK#9a", [Ack(), Packet(b"OK")]),
    ("error", b"+$E14#aa", [Ack(), Packet(b"E14")]),
    ("unsupported", b"+$#00", [Ack(), Packet(b"")]),
    (
        "connect",  # the unsolicited stop comes before the qSupported answer
        b"+"
        + pkt(b"T02thread:01;")
        + pkt(b"PacketSize=1000;qXfer:features:read+;ReverseStep+;ReverseContinue+;multiprocess+"),
        [
            Ack(),
            Packet(b"T02thread:01;"),
            Packet(b"PacketSize=1000;qXfer:features:read+;ReverseStep+;ReverseContinue+;multiprocess+"),
        ],
    ),
    (
        "threads",
        b"+$mp01.01,p01.02#" + csum(b"mp01.01,p01.02") + b"+$l#6c",
        [Ack(), Packet(b"mp01.01,p01.02"), Ack(), Packet(b"l")],
    ),
    ("run-length", b"+" + pkt(REGS_RLE, raw=True), [Ack(), Packet(b"0" * 32 + b"0" * 32 + b"10f0ffffffff")]),
    ("escaped", b"+" + pkt(b"l<x>}#$*</x>"), [Ack(), Packet(b"l<x>}#$*</x>")]),
    ("nak", b"-+$OK#9a", [Nak(), Ack(), Packet(b"OK")]),
    ("acks-between", b"+$OK#9a++$OK#9a+", [Ack(), Packet(b"OK"), Ack(), Ack(), Packet(b"OK"), Ack()]),
    ("notification", b"%" + pkt(b"Stop:T05thread:p01.01;")[1:], [Notification(b"Stop:T05thread:p01.01;")]),
    ("binary", b"+" + pkt(bytes(range(256))), [Ack(), Packet(bytes(range(256)))]),
]


@pytest.mark.parametrize(("stream", "events"), [s[1:] for s in STREAMS], ids=[s[0] for s in STREAMS])
def test_parser_whole_stream(stream: bytes, events: list[Event]) -> None:
    assert PacketParser().feed(stream) == events


def chunked(data: bytes, seed: int, lo: int = 1, hi: int = 100) -> list[bytes]:
    rnd = random.Random(seed)
    out, i = [], 0
    while i < len(data):
        n = rnd.randint(lo, hi)
        out.append(data[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(12))
def test_parser_any_chunking_gives_the_same_events(seed: int) -> None:
    stream = b"".join(s[1] for s in STREAMS)
    expected = [e for s in STREAMS for e in s[2]]
    parser = PacketParser()
    got: list[Event] = []
    for part in chunked(stream, seed):
        got += parser.feed(part)
    assert got == expected


def test_parser_byte_at_a_time() -> None:
    stream = b"".join(s[1] for s in STREAMS)
    parser = PacketParser()
    got = [e for b in stream for e in parser.feed(bytes((b,)))]
    assert got == [e for s in STREAMS for e in s[2]]


def test_parser_incomplete_packet_waits() -> None:
    parser = PacketParser()
    assert parser.feed(b"+$O") == [Ack()]
    assert parser.feed(b"K#") == []
    assert parser.feed(b"9") == []  # one checksum digit is not enough
    assert parser.feed(b"a") == [Packet(b"OK")]
    assert parser.feed(b"") == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(st.just(b"+"), st.just(b"-"), st.binary(max_size=80).map(pkt)), max_size=12),
    st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=40),
)
def test_parser_chunking_property(pieces: list[bytes], sizes: list[int]) -> None:
    stream = b"".join(pieces)
    whole = PacketParser().feed(stream)
    parser = PacketParser()
    got: list[Event] = []
    i = k = 0
    while i < len(stream):
        n = sizes[k % len(sizes)]
        got += parser.feed(stream[i : i + n])
        i += n
        k += 1
    assert got == whole
    assert len(whole) == len(pieces)


# -- malformed input ---------------------------------------------------------------

MALFORMED = [
    ("bad-checksum", b"$OK#00", "checksum"),
    ("bad-checksum-after-ack", b"+$OK#9b", "checksum"),
    ("non-hex-checksum", b"$OK#zz", "not hex"),
    ("non-ascii-checksum", b"$OK#\xff\xfe", "not hex"),
    ("stray-byte", b"x$OK#9a", "unexpected byte"),
    ("stray-between-packets", b"$OK#9a\n$OK#9a", "unexpected byte"),
    ("stray-interrupt-byte", b"\x03", "unexpected byte"),
    ("escape-at-end", pkt(b"ab}", raw=True), "escape character at end"),
    ("run-length-first", pkt(b'*"', raw=True), "run-length"),
    ("run-length-at-end", pkt(b"0*", raw=True), "run-length"),
    ("run-length-bad-count", pkt(b"0*\x1f", raw=True), "run-length count"),
]


@pytest.mark.parametrize(("stream", "words"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_raises_protocol_error(stream: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as info:
        PacketParser().feed(stream)
    assert isinstance(info.value, TargetError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("seed", range(4))
def test_malformed_input_raises_in_any_chunking(seed: int) -> None:
    parser = PacketParser()
    with pytest.raises(ProtocolError):  # from whichever chunk completes the bad packet
        for part in chunked(b"+$OK#9a+" + pkt(b"T05") + b"$OK#9b", seed, 1, 5):
            parser.feed(part)


def test_no_end_marker_within_a_mebibyte() -> None:
    parser = PacketParser()
    parser.feed(b"$" + b"0" * (MAX_PACKET // 2))
    with pytest.raises(ProtocolError, match="no end marker"):
        parser.feed(b"0" * (MAX_PACKET // 2 + 8))


@pytest.mark.parametrize("stream", [b"$#-0", b"$#+0", b"$# 0", b"$#0 "])
def test_checksum_with_sign_or_space_is_not_hex(stream: bytes) -> None:
    # Two hex digits follow '#'; int() also takes '+0', '-0', ' 0', which
    # would turn a corrupted empty packet into a valid "not supported" reply.
    with pytest.raises(ProtocolError):
        PacketParser().feed(stream)


# -- complexity guard ---------------------------------------------------------------


class CountingBuffer(bytearray):
    """The parser's buffer, counting the bytes its searches scan and the bytes its slices and indexing read.

    Reading more than ``budget`` bytes fails at once, so a parser gone quadratic fails rather than hangs.
    """

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.searches = 0
        self.scanned = 0
        self.read = 0

    def find(self, sub: bytes, start: int = 0, end: int | None = None, /) -> int:  # type: ignore[override]
        self.searches += 1
        at = super().find(sub, start, end)
        stop = len(self) if end is None else min(end, len(self))
        self.scanned += (stop if at < 0 else at + len(sub)) - start
        return at

    def __getitem__(self, key: SupportsIndex | slice) -> Any:
        got = super().__getitem__(key)
        self.read += 1 if isinstance(got, int) else len(got)
        assert self.read <= self.budget, f"read {self.read} bytes of the buffer, over the budget of {self.budget}"
        return got


def counted_parser(data: bytes) -> tuple[PacketParser, CountingBuffer]:
    """A parser whose buffer may be read three times over while it parses ``data``."""
    parser = PacketParser()
    buf = parser._buf = CountingBuffer(3 * len(data))
    return parser, buf


class CountingBody(bytes):
    """A packet body that counts the bytes read out of it (and fails past ``budget``, for the same reason)."""

    budget = 0
    read = 0

    def __getitem__(self, key: SupportsIndex | slice) -> Any:
        got = super().__getitem__(key)
        CountingBody.read += 1 if isinstance(got, int) else len(got)
        assert CountingBody.read <= CountingBody.budget, f"read {CountingBody.read} bytes of the body"
        return got


# Counted, not timed: the bytes examined per byte of input stay bounded however large the input. The lower
# bounds make sure the counters still see the parser's work (a buffer it replaced would count nothing).


def test_one_megabyte_payload_is_linear() -> None:
    payload = random.Random(7).randbytes(1_000_000)  # ~1/64 of it needs escaping
    data = frame(payload)
    body = data[1:-3]  # first on its own: the parser hands decode_body plain bytes, which count nothing
    CountingBody.read, CountingBody.budget = 0, 2 * len(body)
    assert decode_body(CountingBody(body)) == payload
    assert CountingBody.read >= len(body)

    parser, buf = counted_parser(data)
    assert parser.feed(data) == [Packet(payload)]
    assert len(data) <= buf.scanned + buf.read <= 3 * len(data), (buf.scanned, buf.read)
    assert parser._buf is buf and not buf


def test_one_megabyte_payload_in_small_reads() -> None:
    payload = random.Random(7).randbytes(1_000_000)
    data = frame(payload)
    parts = chunked(data, 1, 1, 100)
    parser, buf = counted_parser(data)
    assert [e for part in parts for e in parser.feed(part)] == [Packet(payload)]
    # One search for the end marker per read. Each fruitless one scans the partial packet again, but in C
    # (bytearray.find) and within MAX_PACKET, so it is the number of searches that must stay linear.
    assert buf.searches == len(parts), (buf.searches, len(parts))
    assert len(payload) <= buf.read <= 2 * len(data), buf.read


def test_many_small_packets_are_linear() -> None:
    data = (b"+" + pkt(b"OK")) * 100_000
    parser, buf = counted_parser(data)
    events = parser.feed(data)
    assert len(events) == 200_000 and events[:2] == [Ack(), Packet(b"OK")]
    # Each packet's search stops at its own '#', and what is consumed is dropped, not copied along.
    assert buf.searches == 100_000
    assert len(data) <= buf.scanned + buf.read <= 2 * len(data), (buf.scanned, buf.read)
    assert parser._buf is buf and not buf


# -- stop replies -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "kind", "signal", "thread", "exited"),
    [
        (b"S05", "S", 5, None, False),
        (b"T05thread:p01.02;swbreak:;", "T", 5, "p1.2", False),
        (b"T02thread:01;", "T", 2, "p1.1", False),
        (b"T05thread:p1a.0f;hwbreak:;", "T", 5, "p1a.f", False),
        (b"T05", "T", 5, None, False),
        (b"T0bthread:p01.01;", "T", 11, "p1.1", False),
        (b"W00", "W", 0, None, True),
        (b"W01;process:1", "W", 1, None, True),
        (b"X09", "X", 9, None, True),
    ],
)
def test_parse_stop_reply(payload: bytes, kind: str, signal: int, thread: str | None, exited: bool) -> None:
    stop = parse_stop_reply(payload)
    assert (stop.kind, stop.signal, stop.thread, stop.exited) == (kind, signal, thread, exited)


def test_stop_reply_fields() -> None:
    stop = parse_stop_reply(b"T05watch:ffffffff81000000;thread:p01.01;swbreak:;")
    assert stop == StopReply("T", 5, "p1.1", (("watch", "ffffffff81000000"), ("thread", "p01.01"), ("swbreak", "")))
    assert stop.field("watch") == "ffffffff81000000"
    assert stop.field("swbreak") == ""
    assert stop.field("hwbreak") is None


@pytest.mark.parametrize("payload", [b"", b"OK", b"E14", b"Tzz", b"S", b"t05", b"\xff05"])
def test_malformed_stop_reply(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed stop reply") as info:
        parse_stop_reply(payload)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("payload", [b"T05thread:zz;", b"T05thread:p01.;", b"T05thread:;"])
def test_stop_reply_with_bad_thread_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_stop_reply(payload)


@pytest.mark.parametrize(
    ("tid", "canonical"),
    [
        ("p01.02", "p1.2"),
        ("01", "p1.1"),
        ("1", "p1.1"),
        ("0a", "p1.a"),
        ("p1.1", "p1.1"),
        ("pA.B", "pa.b"),
        ("p10.1f", "p10.1f"),
        ("p001.0010", "p1.10"),
    ],
)
def test_normalize_thread(tid: str, canonical: str) -> None:
    assert normalize_thread(tid) == canonical


@pytest.mark.parametrize(("text", "data"), [(b"", b""), (b"00ff", b"\x00\xff"), (b"DEADbeef", b"\xde\xad\xbe\xef")])
def test_hex_to_bytes(text: bytes, data: bytes) -> None:
    assert hex_to_bytes(text) == data


@pytest.mark.parametrize("text", [b"0", b"zz", b"\xff\xff", b"E14"])
def test_hex_to_bytes_malformed(text: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed hex"):
        hex_to_bytes(text)


def test_fake_framing_agrees_with_itself() -> None:
    # The fakes' escaping must be the protocol's, or every other test here proves nothing.
    assert esc(b"#$}*") == b"}\x03}\x04}]}\x0a"
