"""arm64's VMCOREINFO lines, in the formats arch_crash_save_vmcoreinfo() prints them."""

from __future__ import annotations

from qprobe.arch.arm64.paging import Arm64PageTables
from qprobe.arch.arm64.vmcoreinfo import arch_crash_save_vmcoreinfo

SYMBOLS = {
    "_text": 0xFFFF_A1B2_C3E0_0000,
    "swapper_pg_dir": 0xFFFF_A1B2_C5A1_4000,
    "memstart_addr": 0xFFFF_A1B2_C5F0_0008,
    "_stext": 0xFFFF_A1B2_C3E1_0000,
}
TEXT_PHYS = 0x4020_0000
TCR_48_4K = 16 << 16 | 16 | 2 << 30


def lines(sctlr: int) -> list[str]:
    memory = {SYMBOLS["memstart_addr"]: 0x4000_0000}

    def virt_to_phys(va: int) -> int:
        # swapper_pg_dir maps the image from _stext on: the header at _text is not there to translate.
        assert va == SYMBOLS["_stext"], f"{va:#x} translated"
        return TEXT_PHYS + va - SYMBOLS["_text"]

    return arch_crash_save_vmcoreinfo(SYMBOLS.__getitem__, virt_to_phys, memory.__getitem__,
                                      Arm64PageTables(TCR_48_4K, sctlr))  # fmt: skip


def test_the_lines_are_the_kernel_s() -> None:
    assert lines(sctlr=1 << 31) == [
        "SYMBOL(swapper_pg_dir)=ffffa1b2c5a14000",  # VMCOREINFO_SYMBOL_ARRAY: %lx
        "NUMBER(VA_BITS)=48",  # VMCOREINFO_NUMBER: %d
        "NUMBER(kimage_voffset)=0xffffa1b283c00000",  # the rest 0x%llx
        "NUMBER(PHYS_OFFSET)=0x40000000",
        "NUMBER(TCR_EL1_T1SZ)=0x10",
        "NUMBER(KERNELPACMASK)=0xffff000000000000",
    ]


def test_without_address_authentication_the_pac_mask_is_zero() -> None:
    assert lines(sctlr=0)[-1] == "NUMBER(KERNELPACMASK)=0x0"
