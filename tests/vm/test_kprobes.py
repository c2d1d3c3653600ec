"""Issue 3: kprobes from the host on the real default image (KASLR on, smp 2)."""

from __future__ import annotations

import pytest

import qprobe
from qprobe import Kprobe
from qprobe.arch.x86_64.decode import decode_all, decode_one
from qprobe.errors import Blacklisted, InvalidProbe, NotInstructionBoundary, NotKernelText, SymbolError

from .conftest import fake_return, workload_result

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("n", [1, 100, 2000])
def test_getppid_counts_exactly(target: qprobe.Target, guard: dict[int, bytes], n: int) -> None:
    kp = Kprobe(symbol_name="__x64_sys_getppid")
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run(f"workload getppid {n}", timeout=600).check().output)
    finally:
        target.unregister_kprobe(kp)
    assert int(res["n"]) == n and int(res["errors"]) == 0
    assert kp.nhit == n
    assert kp.nmissed == 0


def test_pre_handler_reads_the_syscall_arguments(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seen: list[tuple[int, int, int]] = []
    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=lambda kp, regs: seen.append((regs.di, regs.si, regs.dx)))
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload lseek 50").check().output)
    finally:
        target.unregister_kprobe(kp)
    fd = int(res["fd"])
    assert seen == [(fd, i, 0) for i in range(1, 51)]  # lseek(fd, i, SEEK_SET)


def test_both_vcpus_hit_and_each_hit_is_handled_once(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    cpus: list[int] = []
    kp = Kprobe(symbol_name="__x64_sys_getppid", pre_handler=lambda kp, regs: cpus.append(regs.vcpu))
    target.register_kprobe(kp)
    try:
        out = target.run("taskset -c 0 workload getppid 300 & taskset -c 1 workload getppid 300; wait",
                         timeout=600).check().output  # fmt: skip
    finally:
        target.unregister_kprobe(kp)
    assert out.count("errors=0") == 2
    assert kp.nhit == 600 == len(cpus)
    assert cpus.count(0) == 300 and cpus.count(1) == 300


@pytest.mark.parametrize("boost", [True, False])
def test_the_int3_path_on_both_vcpus_at_once(target: qprobe.Target, guard: dict[int, bytes], boost: bool) -> None:
    """No jump optimization: every hit is an int3 trap, heard through the watchpoint in the #BP handler.

    Both vCPUs trap together (QEMU reports one debug stop at a time); every hit
    is handled once, with its own arguments, boosted or single-stepped.
    """
    seen: list[tuple[int, int]] = []
    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=lambda k, regs: seen.append((regs.vcpu, regs.si)))
    target.set_kprobes_optimization(False)
    target.kprobes.dispatcher.boost = boost
    try:
        target.register_kprobe(kp)
        # This kernel's #BP handler has the watched read: no breakpoint stops.
        assert target.kprobes.dispatcher.watch_refs
        out = target.run("taskset -c 0 workload lseek 150 & taskset -c 1 workload lseek 150; wait",
                         timeout=600).check().output  # fmt: skip
        target.unregister_kprobe(kp)
    finally:
        target.kprobes.dispatcher.boost = True
        target.set_kprobes_optimization(True)
    assert out.count("errors=0") == 2 and kp.nhit == 300 and kp.nmissed == 0
    for cpu in (0, 1):
        assert [off for c, off in seen if c == cpu] == list(range(1, 151))
    assert target.kprobes.points == {} and target.oopses() == []


def _mov_reg_reg(target: qprobe.Target, func: str) -> tuple[int, str, str]:
    """The first ``mov r64, r64`` in a function: (address, destination, source)."""
    sym = target.symbols.lookup(func)
    for insn in decode_all(target.read(sym.addr, sym.size), sym.addr):
        text = insn.text
        if text.startswith("mov ") and "," in text and "[" not in text:
            dst, src = (x.strip() for x in text[4:].split(","))
            if dst.startswith("r") and src.startswith("r") and len(dst) == 3 and len(src) == 3:
                return insn.addr, dst, src
    raise AssertionError(f"no mov reg,reg in {func}")


def test_post_handler_sees_the_state_after_the_instruction(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    addr, dst, src = _mov_reg_reg(target, "ksys_lseek")
    # (With frame pointers the first one is the prologue's mov rbp, rsp.)
    pt = {"rax": "ax", "rbx": "bx", "rcx": "cx", "rdx": "dx", "rsi": "si", "rdi": "di", "rbp": "bp", "rsp": "sp"}
    pre: list[int] = []
    post: list[tuple[int, int]] = []
    kp = Kprobe(addr=addr, pre_handler=lambda kp, r: pre.append(getattr(r, pt.get(src, src))),
                post_handler=lambda kp, r: post.append((getattr(r, pt.get(dst, dst)), r.ip)))  # fmt: skip
    target.register_kprobe(kp)
    try:
        target.run("workload lseek 5").check()
    finally:
        target.unregister_kprobe(kp)
    assert len(pre) == len(post) == 5
    length = decode_one(target.read(addr, 16), addr).length
    assert post == [(v, addr + length) for v in pre]


def test_handler_changes_what_the_guest_sees(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    kp = Kprobe(symbol_name="__x64_sys_getppid", pre_handler=fake_return(4242))
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload getppid 3").check().output)
    finally:
        target.unregister_kprobe(kp)
    assert res["ret"] == "4242" and kp.nhit == 3
    assert workload_result(target.run("workload getppid 1").output)["ret"] != "4242"


def test_two_probes_at_one_address_both_run(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    a, b = Kprobe(symbol_name="ksys_lseek"), Kprobe(symbol_name="ksys_lseek")
    target.register_kprobes([a, b])
    assert target.list_probes().count("ksys_lseek+0x0") == 2
    try:
        target.run("workload lseek 7").check()
        target.disable_kprobe(b)
        assert "[DISABLED]" in target.list_probes()
        target.run("workload lseek 3").check()
    finally:
        target.unregister_kprobes([a, b])
    assert (a.nhit, b.nhit) == (10, 7)


def test_handler_exception_is_counted_and_the_probe_stays_armed(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    faults: list[BaseException] = []

    def boom(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        raise RuntimeError("handler bug")

    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=boom, fault_handler=lambda kp, r, e: faults.append(e))
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload lseek 4").check().output)
    finally:
        target.unregister_kprobe(kp)
    assert int(res["errors"]) == 0 and kp.nhit == 4 and kp.nfaults == 4 and len(faults) == 4
    assert "RuntimeError: handler bug" in kp.errors[0]


def test_global_disarm_keeps_each_probes_state(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    kp = Kprobe(symbol_name="ksys_lseek")
    target.register_kprobe(kp)
    try:
        target.set_kprobes_enabled(False)
        target.run("workload lseek 5").check()
        assert kp.nhit == 0
        target.set_kprobes_enabled(True)
        target.run("workload lseek 5").check()
        assert kp.nhit == 5
    finally:
        target.unregister_kprobe(kp)


def _inside_an_instruction(target: qprobe.Target, func: str) -> int:
    """An offset into ``func`` that is not an instruction boundary (the second byte of a long instruction)."""
    sym = target.symbols.lookup(func)
    return next(i.addr + 1 - sym.addr for i in decode_all(target.read(sym.addr, sym.size), sym.addr) if i.length > 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"symbol_name": "vfs_read", "offset": "inside"}, NotInstructionBoundary, "not an instruction boundary"),
        ({"symbol_name": "asm_exc_int3"}, Blacklisted, "blacklisted"),
        # do_int3 is NOKPROBE_SYMBOL; a kernel without CONFIG_KPROBES has none, and its exc_int3 is noinstr.
        ({"symbol_name": ("do_int3", "exc_int3")}, Blacklisted, "blacklisted"),
        ({"symbol_name": "no_such_function_xyz"}, SymbolError, "unknown symbol"),
        ({"symbol_name": "jiffies"}, NotKernelText, "not in kernel text"),
    ],
)
def test_bad_probes_are_refused_and_change_nothing(target: qprobe.Target, guard: dict[int, bytes],
                                                   kwargs: dict, error: type, match: str) -> None:  # fmt: skip
    kwargs = dict(kwargs)
    if isinstance(kwargs["symbol_name"], tuple):
        kwargs["symbol_name"] = next(n for n in kwargs["symbol_name"] if n in target.symbols)
    if kwargs.get("offset") == "inside":
        kwargs["offset"] = _inside_an_instruction(target, kwargs["symbol_name"])
    before = dict(target.journal.patches)
    with pytest.raises(error, match=match) as e:
        target.register_kprobe(Kprobe(**kwargs))
    assert "\n" not in str(e.value)
    assert target.journal.patches == before and not target.kprobes.points


def test_symbol_and_address_together_is_einval(target: qprobe.Target) -> None:
    with pytest.raises(InvalidProbe, match="EINVAL"):
        Kprobe(symbol_name="vfs_read", addr=target.symbols.address("vfs_read"))


def test_arguments_by_position_and_by_name(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seen: list[tuple[int, int, int, int]] = []
    kp = Kprobe(
        symbol_name="ksys_lseek",
        pre_handler=lambda k, r: seen.append((r.arg(1), r.arg("fd"), r.arg("offset"), r.arg("whence"))),
    )
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload lseek 3").check().output)
    finally:
        target.unregister_kprobe(kp)
    fd = int(res["fd"])
    assert seen == [(fd, fd, i, 0) for i in (1, 2, 3)]
    assert kp.nfaults == 0


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")  # the guest's own kprobe event shares the site
def test_never_writes_a_site_the_guests_own_ftrace_uses(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """With the guest's own probe on ksys_lseek's __fentry__ site, qprobe's probe there goes after it."""
    tracing = "/sys/kernel/tracing"
    target.run(f"echo 'p:guestk ksys_lseek' > {tracing}/kprobe_events && "
               f"echo 1 > {tracing}/events/kprobes/guestk/enable").check()  # fmt: skip
    kp = Kprobe(symbol_name="ksys_lseek")
    try:
        target.register_kprobe(kp)
        target.run("workload lseek 2").check()
        listing = target.list_probes()
        target.unregister_kprobe(kp)
        profile = target.run(f"cat {tracing}/kprobe_profile").check().output
    finally:
        target.run(f"echo 0 > {tracing}/events/kprobes/guestk/enable; "
                   f"echo '-:guestk' >> {tracing}/kprobe_events").check()  # fmt: skip
    start = target.symbols.address("ksys_lseek")
    assert kp.nhit == 2 and kp.at == start and kp.resolved == start + 5
    assert f"{start:016x}  k  ksys_lseek+0x0    [FTRACE]" in listing
    assert profile.split()[:2] == ["guestk", "2"]
