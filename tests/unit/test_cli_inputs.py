"""Issue 8: every CLI input a user can get wrong gives one line naming the problem, before anything boots."""

from __future__ import annotations

from pathlib import Path

import pytest

import qprobe
from qprobe import cli
from qprobe.cli import host


@pytest.fixture(autouse=True)
def no_vm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before a VM exists: booting or attaching fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a VM was booted or attached for bad input")

    monkeypatch.setattr(qprobe, "boot", refuse)
    monkeypatch.setattr(qprobe, "attach", refuse)


CASES = [
    # (argv, words the one-line error must contain)
    ([], ["required", "COMMAND"]),
    (["frobnicate"], ["invalid choice", "frobnicate"]),
    (["trace"], ["required", "EVENT"]),
    (["trace", "--smp", "0", "p:a vfs_read"], ["--smp", "outside 1..64"]),
    (["trace", "--smp", "two", "p:a vfs_read"], ["--smp", "'two' is not a number"]),
    (["trace", "--memory", "lots", "p:a vfs_read"], ["--memory", "bad memory size"]),
    (["trace", "--memory", "16M", "p:a vfs_read"], ["--memory", "outside 128M..64G"]),
    (["trace", "--duration", "-1", "p:a vfs_read"], ["--duration", "outside"]),
    (["trace", "--timeout", "x", "p:a vfs_read"], ["--timeout", "not a number"]),
    (["trace", "--transport", "serial", "p:a vfs_read"], ["--transport", "invalid choice"]),
    (["trace", "--image", "no-such-image", "p:a vfs_read"], ["unknown image 'no-such-image'"]),
    (["trace", "--file", "nocolon", "p:a vfs_read"], ["bad --file 'nocolon'"]),
    (["trace", "--file", "/etc/hostname:relative", "p:a vfs_read"], ["bad --file", "/GUEST/PATH"]),
    (["trace", "--file", "/no/such/file:/bin/x", "p:a vfs_read"], ["/no/such/file is not a readable file"]),
    (["trace", "p:a vfs_read x=%zz"], ["Invalid register name"]),
    (["trace", "p:a vfs_read+ x=%ax"], ["Invalid probed address or symbol"]),
    (["trace", "q:a vfs_read"], ["Not a kprobe definition"]),
    (["trace", "r:a vfs_read+8"], ["Retprobe address must be an function entry"]),
    (["trace", "p:a vfs_read s=+0(%si):strung"], ["Unknown type is specified"]),
    # In the image's kernel's language: 6.1's has no BTF arguments (6.12's would take these).
    (["trace", "p:a vfs_read file"], ["Invalid fetch argument"]),
    (["list", "r:a ksys_lseek $arg1"], ["Invalid $-variable specified"]),
    (["trace", "--filter", "nope == 1", "p:a vfs_read c=%dx"], ["Field not found"]),
    (["trace", "--filter", "c ~ 1", "p:a vfs_read c=%dx"], ["Illegal operation for field type"]),
    (["trace", "--filter", "c == x", "p:a vfs_read c=%dx"], ["Illegal integer value"]),
    (["list", "--smp", "100"], ["--smp", "outside 1..64"]),
    (["boot", "--memory", "0"], ["--memory", "outside"]),
    (["bench", "--hits", "0"], ["--hits", "outside 1..1000000000"]),
    (["bench", "--sections", "probes,kvm"], ["--sections", "sections are probes, trace, scale, gdb"]),
    (["shell", "--image", "nope"], ["unknown image 'nope'"]),
    (["attach", "10.1.2.3:1234"], ["refusing to attach to non-local 10.1.2.3"]),
    (["attach", ""], ["empty gdbstub address"]),
    (["trace", "--attach", "", "p:a vfs_read"], ["empty gdbstub address"]),
    (["shell", "--attach", ""], ["empty gdbstub address"]),
    (["list", "--attach", " "], ["empty gdbstub address"]),
    (["attach", "unix:"], ["unix: needs the socket's path"]),
    (["attach", "127.0.0.1:70000"], ["port in 1..65535"]),
    (["attach", "127.0.0.1:65536"], ["port in 1..65535"]),
    (["attach", "localhost:0"], ["port in 1..65535"]),
    (["attach", "localhost:http"], ["port in 1..65535"]),
    (["attach", ":1234"], ["HOST:PORT"]),
    (["trace", "--attach", "unix:/nonexistent", "p:a vfs_read"], ["no such socket /nonexistent"]),
    (["attach", "/etc/hostname"], ["/etc/hostname is not a socket"]),
    (["images", "--fetch"], ["--fetch", "expected at least one argument"]),
    (["list", "vfs_*"], ["to find functions: qprobe funcs 'vfs_*'"]),
    (["list", "pci_*"], ["to find functions: qprobe funcs 'pci_*'"]),
    # The shell's EVENTs, checked as trace's are; --boot's are the kernel's.
    (["shell", "p:a vfs_read x=%zz"], ["Invalid register name"]),
    (["shell", "--boot", "p:a vfs_read x=%zz"], ["Invalid register name"]),
    (["shell", "--boot", "p:a no_such_function_here"], ["no_such_function_here"]),
    (["shell", "p:sk start_kernel"], ["start_kernel", "not kernel text after boot"]),
    (["shell", "--boot"], ["--boot arms the EVENTs", "give at least one"]),
    (["shell", "--kernel-image", "/boot/vmlinuz", "p:a start_kernel"], ["only with --boot --attach"]),
    (["shell", "--boot", "p:uq /bin/true:main"], ["p:uq /bin/true:main", "a uprobe's file is the guest's"]),
    (["shell", "--boot", "uprobe:/bin/true:main"], ["a uprobe's file is the guest's"]),
    (["trace", "--boot", "p:uq /bin/true:main"], ["a uprobe's file is the guest's"]),
    (["trace", "--boot", "--transport", "gdb", "p:a start_kernel"], ["not with --transport gdb"]),
    (["shell", "--boot", "--transport", "gdb", "p:a start_kernel"], ["not with --transport gdb"]),
]


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0]) or "(none)" for c in CASES])
def test_bad_cli_input_is_one_line_naming_the_problem(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if argv[:1] == ["attach"] or "--attach" in argv:
        monkeypatch.undo()  # attach's own check runs before it connects to anything
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, err
    first = err.splitlines()[0]
    assert first.startswith("qprobe: error: "), err
    for word in words:
        assert word in first, (word, first)
    # Event and filter errors add the kernel's two caret lines; everything else is one line.
    assert len(err.splitlines()) in ((1,) if "^" not in err else (3,)), err


def test_help_documents_every_command_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("boot", "attach", "trace", "list", "images", "blacklist", "shell", "demo", "bench"):
        assert command in out
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("qprobe ")


def test_a_readable_extra_file_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "tool"
    f.write_text("#!/bin/sh\n")
    assert host._files([f"{f}:/bin/tool"]) == {"/bin/tool": str(f)}


def test_allow_remote_warns_that_the_stub_is_unauthenticated(caplog: pytest.LogCaptureFixture,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.undo()
    # 127.0.0.2 is not one of the local names qprobe accepts without --allow-remote; nothing listens there.
    assert cli.main(["attach", "127.0.0.2:1"]) == 2
    assert "refusing to attach to non-local 127.0.0.2" in capsys.readouterr().err
    with caplog.at_level("WARNING", logger="qprobe"):
        assert cli.main(["attach", "127.0.0.2:1", "--allow-remote", "--vmlinux", "/nonexistent"]) == 2
    assert "anyone who can reach that port controls the guest" in caplog.text
    assert "cannot connect to the gdbstub at 127.0.0.2:1" in capsys.readouterr().err


def test_shell_boot_hands_its_checked_events_to_a_boot_that_arms_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, object] = {}

    def boot(image: str, **kwargs: object) -> None:
        seen.update(kwargs, image=image)
        raise qprobe.QprobeError("stopped before QEMU")

    monkeypatch.setattr(qprobe, "boot", boot)
    # start_kernel is __init: refused on a booted kernel, probed during the boot.
    assert cli.main(["shell", "--boot", "--cmdline", "initcall_debug", "p:sk start_kernel"]) == 2
    assert "stopped before QEMU" in capsys.readouterr().err
    assert seen["image"] == "debian-cloud" and seen["cmdline"] == "initcall_debug" and callable(seen["at_boot"])


def test_trace_reports_every_hit_of_its_run_that_waited_those_while_it_armed_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rings are this process's, zeroed when it lays them out: their count is this run's, and the hits
    of the events armed first wait on a full ring while the others are armed (a glob of hundreds)."""
    import contextlib
    from collections.abc import Iterator
    from types import SimpleNamespace

    from qprobe.cli import trace as trace_cli

    waits = [0]
    target = SimpleNamespace(record_waits=lambda: waits[0], machine=SimpleNamespace(alive=True))

    @contextlib.contextmanager
    def attached(args: object, at_boot: object = None) -> Iterator[object]:
        yield target

    def arm(*args: object) -> list[object]:
        waits[0] = 7  # the rings filled while the events were armed
        return []

    def run(*args: object) -> int:
        waits[0] = 10
        return 0

    monkeypatch.setattr(trace_cli, "_boot", attached)
    monkeypatch.setattr(trace_cli, "_arm_traced", arm)
    monkeypatch.setattr(trace_cli, "_collect", run)
    assert cli.main(["trace", "--attach", "unix:/nonexistent/gdb.sock", "--duration", "1", "p:rd vfs_read"]) == 0
    assert capsys.readouterr().out == "# records: waited=10\n"


def test_trace_lines_go_out_in_blocks_flushed_after_each_run_the_timeline_hands_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A line a hit is written but not flushed (a write each was a system call a line); the timeline's flush
    after the run it handed on sends them together, so a pipe sees them at once all the same."""
    import io

    from qprobe.cli.output import _Trace
    from qprobe.events import EventHit
    from qprobe.events.timeline import Timeline

    class Out(io.StringIO):
        flushed: list[str] = []

        def flush(self) -> None:
            self.flushed.append(self.getvalue())

    out = Out()
    monkeypatch.setattr("sys.stdout", out)
    trace = _Trace(cli.build_parser().parse_args(["trace", "p:rd vfs_read"]))
    tl = Timeline()
    tl.flushers.append(trace.flush)
    hits = [EventHit("rd", 0, 7, "cat", ts, 0x1000, "vfs_read+0x0", {}, "(vfs_read+0x0/0x10)") for ts in (1, 1.01, 5)]
    with tl.batch():
        for hit in hits:
            tl.push(hit.ts, lambda hit=hit: trace.show(hit))  # type: ignore[misc]
    lines = [hit.line() + "\n" for hit in hits]
    assert out.flushed == ["".join(lines[:2])]  # the two a window older than the last, in one flush
    tl.flush()
    assert out.flushed == ["".join(lines[:2]), "".join(lines)]
    tl.close()


def test_trace_buffer_size_kb_sizes_the_rings_before_anything_is_armed(capsys: pytest.CaptureFixture[str]) -> None:
    """--buffer-size-kb is each CPU's ring in KiB, as ftrace's buffer_size_kb; at least 1, and left alone unless
    given (the rings' own default then)."""
    from types import SimpleNamespace

    from qprobe.cli.trace import _size_rings

    parser = cli.build_parser()
    target = SimpleNamespace(records_buffer_size_kb=0)
    _size_rings(target, parser.parse_args(["trace", "--buffer-size-kb", "2048", "p:rd vfs_read"]))  # type: ignore[arg-type]
    assert target.records_buffer_size_kb == 2048
    _size_rings(target, parser.parse_args(["trace", "p:rd vfs_read"]))  # type: ignore[arg-type]
    assert target.records_buffer_size_kb == 2048
    with pytest.raises(SystemExit):
        parser.parse_args(["trace", "--buffer-size-kb", "0", "p:rd vfs_read"])
    assert "outside 1.." in capsys.readouterr().err


def test_images_lists_the_names_in_a_column_as_wide_as_the_longest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import qprobe.images
    from qprobe.images import ImageInfo

    infos = [
        ImageInfo("debian-cloud", "Debian 12 cloud kernel 6.1", "debian:cloud-amd64", "ready", "initramfs"),
        ImageInfo(
            "debian-cloud-arm64-6.12", "Debian 12's 6.12 arm64", "debian:cloud-arm64", "not fetched", "initramfs"
        ),
    ]
    monkeypatch.setattr(qprobe.images, "list_images", lambda: infos)
    assert cli.main(["images"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "debian-cloud            ready        Debian 12 cloud kernel 6.1",
        "debian-cloud-arm64-6.12 not fetched  Debian 12's 6.12 arm64",
    ]


def test_trace_prints_a_run_s_lines_in_one_write_only_the_command_s_with_run() -> None:
    """``_Trace.show_run``: a slice of a ring's run as one block of EventHit.line's lines; with --run only the
    hits of the command's process tree, counted as shown; plain lines only when not to a terminal."""
    import io
    from types import SimpleNamespace

    from qprobe.cli.output import _Trace
    from qprobe.events import EventHit
    from qprobe.events.lines import LineFormat, LineRun, line_head

    hits = [EventHit("rd", n % 2, 7 + n, "cat", 1 + n / 10, 0x1000, "vfs_read+0x0", {"n": str(n)},
                     f"(vfs_read+0x0/0x10) n={n}", irqs_off=n == 2) for n in range(4)]  # fmt: skip
    run = LineRun("rd", [h.ts for h in hits], [h.ts for h in hits], [h.pid for h in hits],
                  [line_head(h.comm, h.pid, h.cpu, h.irqs_off) for h in hits],
                  LineFormat("rd", "(vfs_read+0x0/0x10)", ["n"]).tails(4, [[str(n) for n in range(4)]]))  # fmt: skip
    trace = _Trace(cli.build_parser().parse_args(["trace", "--run", "cat x", "p:rd vfs_read n=%di"]))
    trace.tty, trace.out = False, io.StringIO()
    assert trace.bulk
    trace.show_run(run, 0, 4)  # the command's tree not followed yet: none is its
    trace.tree = SimpleNamespace(owns_pid=lambda pid: pid in (8, 9))  # type: ignore[assignment]
    trace.show_run(run, 1, 4)
    assert trace.out.getvalue() == "".join(h.line() + "\n" for h in hits[1:] if h.pid in (8, 9))
    assert trace.shown["rd"] == 2
    trace.tty = True
    assert not trace.bulk
