"""Where a jump-optimized probe's Python hit spends its time, for docs/performance.md.

Boots the default image (smp 2), puts an ``o`` probe (jump-optimized, Python
pre_handler reading ``regs.di``) on ``ksys_lseek`` and runs ``workload lseek``,
with timestamps on both sides of the doorbell:

- in the guest, the mailbox stub of this run only is rebuilt with ``rdtsc``
  stores into the mailbox's spare words: at stub entry (registers pushed),
  before the request is published, after the doorbell's ``out`` returns, and
  when the spin sees the host's answer;
- on the host, the same TSC (read with ``rdtsc`` through ctypes; under TCG the
  guest's TSC is the host's plus an offset that is constant while the VM
  runs) when ``recv`` returns, after the mailbox is read and the regs object
  built, around the handler, and after the answer is published.

The offset between the two clocks is bounded from both sides by causality
(the guest sees the answer after the host wrote it; the host hears the
doorbell after the guest rang it); the wake-up figure is given with the
offset at the lower bound, i.e. all of the unknown part counted as wake-up.

    PYTHONPATH=. .venv/bin/python scripts/bench-doorbell.py [HITS]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import struct
import sys
import time

from iced_x86 import BlockEncoder, Code, Decoder, Instruction, Mnemonic, Register

import qprobe
from qprobe.arch.x86_64 import detour as detour_mod

# Spare mailbox words (the layout's fields end at MB_FINAL_SP + 8, the registers start at MB_REGS).
# Absolute stamps, then spans (differences of two stamps of the same hit, same vCPU).
T_ENTRY, T_PUBLISH, T_OUT_AT, T_PREP, T_OUT, T_WAIT = 0x50, 0x58, 0x60, 0x68, 0x70, 0x78
T_RUNG = detour_mod.MB_REGS + detour_mod.FRAME_SIZE  # doorbells rung, past the frame copy


def host_rdtsc() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``rdtsc; shl rdx, 32; or rax, rdx; ret`` in an executable page, callable from Python."""
    code = bytes.fromhex("0f31" "48c1e220" "4809d0" "c3")  # fmt: skip
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fn = ctypes.CFUNCTYPE(ctypes.c_uint64)(addr)
    fn._page = page  # keep the mapping alive as long as the function
    return fn


def stamp(slot: int, since: int | None = None) -> list[Instruction]:
    """``rdtsc`` into ``[rbx + slot]`` (rbx holds the mailbox), minus ``[rbx + since]`` if given."""
    c = Instruction
    code = [
        c.create(Code.RDTSC),
        c.create_reg_i32(Code.SHL_RM64_IMM8, Register.RDX, 32),
        c.create_reg_reg(Code.OR_R64_RM64, Register.RAX, Register.RDX),
    ]
    if since is not None:
        code.append(c.create_reg_mem(Code.SUB_R64_RM64, Register.RAX, detour_mod._mem("rbx", since)))
    return [*code, c.create_mem_reg(Code.MOV_RM64_R64, detour_mod._mem("rbx", slot), Register.RAX)]


_LIBRARY_STUB = detour_mod.build_stub  # what stamped_stub decorates (main() puts stamped_stub in its place)


def stamped_stub(p: detour_mod.StubParams, address: int) -> bytes:
    """The library's stub, decoded, with ``stamp``s inserted where the module docstring says.

    Spans the host reads after the fact are stored as differences of two stamps
    taken by the same vCPU (the host's cores need not agree on their TSCs).
    """
    plain = _LIBRARY_STUB(p, address)
    insns = list(Decoder(64, plain, ip=address))
    out: list[Instruction] = []
    first_lea = next(i for i, x in enumerate(insns) if x.code == Code.LEA_R64_M and x.op0_register == Register.RBX)
    for i, insn in enumerate(insns):
        publish = insn.code == Code.MOV_RM64_IMM32 and insn.memory_displacement == detour_mod.MB_STATE \
            and insn.immediate(1) == detour_mod.STATE_REQUEST  # fmt: skip
        if publish:
            out += stamp(T_PREP, T_ENTRY)
            out += stamp(T_PUBLISH)
        if insn.mnemonic == Mnemonic.PAUSE and os.environ.get("NOPAUSE"):
            nop = Instruction.create(Code.NOPD)
            nop.ip = insn.ip
            insn = nop
        out.append(insn)
        if i == first_lea:
            out += stamp(T_ENTRY)
        if insn.mnemonic == Mnemonic.OUT:
            out += stamp(T_OUT_AT)
            out += stamp(T_OUT, T_PUBLISH)
            out.append(Instruction.create_mem(Code.INC_RM64, detour_mod._mem("rbx", T_RUNG)))
        if insn.mnemonic == Mnemonic.JNE and i > 0 and insns[i - 1].mnemonic == Mnemonic.CMP \
                and insns[i - 1].immediate(1) == detour_mod.STATE_DONE:  # fmt: skip
            out += stamp(T_WAIT, T_PUBLISH)
    enc = BlockEncoder(64)
    enc.add_many(out)
    return bytes(enc.encode(address))


def main() -> None:
    hits = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    tsc = host_rdtsc()
    detour_mod.build_stub = stamped_stub  # this run's stub only
    samples: list[tuple[int, ...]] = []
    handler_times: list[tuple[int, int]] = []
    regs_built: list[int] = []
    with qprobe.boot("debian-cloud", smp=2) as t:
        print(f"qprobe from {qprobe.__file__}; {platform_line()}")
        opt = t.kprobes.optimizer
        assert opt is not None and opt.available, "this image/VM has no doorbell"

        def pre(kp: qprobe.Kprobe, regs: qprobe.PtRegs) -> int:
            h = tsc()
            regs.di  # noqa: B018 - what the bench's handler does
            handler_times.append((h, tsc()))
            return 0

        kp = qprobe.Kprobe(symbol_name="ksys_lseek", pre_handler=pre)
        t.register_kprobe(kp)
        assert "[OPTIMIZED]" in t.list_probes(), t.list_probes()
        ram, scratch = opt.ram, t.kprobes.scratch
        assert ram is not None
        bell = opt.doorbell
        assert bell is not None
        serve, make_regs = bell.serve, bell.make_regs
        last_span = [0]

        def doorbells() -> int:
            return sum(ram.read_u64_phys(scratch.phys_of(opt.mailboxes + cpu * detour_mod.MAILBOX_SIZE) + T_RUNG)
                       for cpu in range(t.vcpus))  # fmt: skip

        def timed_make_regs(values: dict[str, int], tid: str) -> qprobe.PtRegs:
            r = make_regs(values, tid)
            regs_built.append(tsc())
            return r

        def timed_serve(cpu: int) -> None:
            h1 = tsc()
            mb = scratch.phys_of(opt.mailboxes + cpu * detour_mod.MAILBOX_SIZE)
            prep, out, wait_prev = struct.unpack("<3Q", ram.read_phys(mb + T_PREP, 24))
            n_handler = len(handler_times)
            serve(cpu)
            h5 = tsc()
            if len(handler_times) == n_handler + 1 and regs_built:
                samples.append((prep, out, wait_prev, h1, regs_built[-1], *handler_times[-1], h5, last_span[0]))
                last_span[0] = h5 - h1

        bell.serve = timed_serve  # type: ignore[method-assign]
        bell.make_regs = timed_make_regs
        cmd = f"workload lseek {hits}"
        t.disable_kprobe(kp)
        unprobed = min(guest_seconds(t, cmd) for _ in range(3))
        t.enable_kprobe(kp)
        samples.clear()
        rung_before = doorbells()
        last_span[0] = 0  # the previous run's
        probed = guest_seconds(t, cmd)
        print(f"{cmd}: unprobed {unprobed / hits * 1e6:.2f} µs/iteration, probed {probed / hits * 1e6:.2f} "
              f"({(probed - unprobed) / hits * 1e6:.1f} µs added per hit), {kp.nhit} hits, "
              f"{len(samples)} timed, {doorbells() - rung_before} doorbells")  # fmt: skip
        t.unregister_kprobe(kp)
    with open("/tmp/bench-doorbell.samples", "w") as f:
        f.write(repr((samples, hits, probed - unprobed)))
    report(samples, hits, probed - unprobed)


def platform_line() -> str:
    import platform

    return f"{platform.node()} {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}"


def guest_seconds(t: qprobe.Target, cmd: str) -> float:
    start = time.perf_counter()
    t.run(cmd, timeout=600).check()
    return time.perf_counter() - start


def report(samples: list[tuple[int, ...]], hits: int, added: float) -> None:
    hz = tsc_hz()

    def med(values: list[int]) -> str:
        return f"{statistics.median(values) / hz * 1e6:.1f} | {statistics.fmean(values) / hz * 1e6:.1f}"

    samples = samples[1:]  # the first one's recv time is the previous run's
    # The guest's wait (request published → answer seen, one vCPU's clock) less the host's span (recv or
    # poll → answer published, one host thread's clock) of the same hit: getting there and back.
    waits = [s[2] for s in samples if s[2] < 1 << 40]
    crossings = [s[2] - s[8] for s in samples if s[8] and s[2] < 1 << 40]
    segments = [
        ("guest: stub entry → request published (mailbox, CR3, per-CPU base, copy)", med([s[0] for s in samples])),
        ("guest: `out` to the doorbell, when rung (exit, BQL, debugcon, socket write)", med([s[1] for s in samples])),
        ("crossings: request → host sees it, answer → guest sees it (wait less host span)", med(crossings)),
        ("host: seen → regs object built (mailbox read, dicts, PtRegs)", med([s[4] - s[3] for s in samples])),
        ("host: regs built → handler entered (nhit, lock, handler list)", med([s[5] - s[4] for s in samples])),
        ("host: the handler (`regs.di`, two rdtsc calls)", med([s[6] - s[5] for s in samples])),
        ("host: handler returned → answer published (dirty, write-back, DONE)", med([s[7] - s[6] for s in samples])),
    ]  # fmt: skip
    print(f"TSC {hz / 1e9:.3f} GHz; {len(samples)} hits timed\n")
    print("| segment | median µs | mean µs |\n|---|---|---|")
    for what, value in segments:
        print(f"| {what} | {value} |")
    print(f"| guest: request published → answer seen (all of the above from the publish on) | {med(waits)} |")
    print(f"| µs added per hit (probed - unprobed loop, instrumented) | | {added / hits * 1e6:.1f} |")


def tsc_hz() -> float:
    """The host TSC's rate, against the monotonic clock (/proc/cpuinfo's MHz is the core clock)."""
    fn = host_rdtsc()
    a, ta = fn(), time.perf_counter_ns()
    time.sleep(0.5)
    b, tb = fn(), time.perf_counter_ns()
    return (b - a) / (tb - ta) * 1e9


if __name__ == "__main__":
    main()
