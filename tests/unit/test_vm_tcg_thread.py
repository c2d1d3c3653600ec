"""A VM test module that enables the guest kernel's own uprobe events boots its VM on one TCG thread.

Enabling or disabling a guest event patches the kernel's text through text_poke_bp, which QEMU 7.2's
multi-threaded TCG can wedge the guest on for good (tests/vm/one_tcg_thread.py); a uprobe test often has
no kprobe of qprobe's armed, whose trap hook would step the stale int3 away.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

VM = Path(__file__).resolve().parents[1] / "vm"
ENABLES = re.compile(r"events/uprobes[^\s'\"]*/enable")


def one_tcg_thread(tree: ast.Module) -> bool:
    """Whether the module's ``qprobe_boot_kwargs`` is the one-TCG-thread fixture (imported or its own)."""
    for node in tree.body:
        imported = isinstance(node, ast.ImportFrom) and node.module == "one_tcg_thread" and node.level == 1
        if imported and any(a.name == "qprobe_boot_kwargs" and a.asname is None for a in node.names):
            return True
        if isinstance(node, ast.FunctionDef) and node.name == "qprobe_boot_kwargs":
            return any(isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "tcg_thread"
                                                       and isinstance(v, ast.Constant) and v.value == "single"
                                                       for k, v in zip(n.keys, n.values, strict=True))
                       for n in ast.walk(node))  # fmt: skip
    return False


# arm64's kernel patches a static key's branch with one store of one instruction (aarch64_insn_patch_text_nosync),
# no int3 for a vCPU to trap on and no IPI for the other to wait in.
NOT_X86 = {"test_arm64.py"}
# Shows that qprobe's in-guest uprobes keep the trap hook, which ends the loop: booted on purpose without the fixture.
HOOKED = {"test_uprobe_inguest_mttcg.py"}
ENABLING = sorted(p.name for p in VM.glob("test_*.py")
                  if ENABLES.search(p.read_text()) and p.name not in NOT_X86 | HOOKED)  # fmt: skip


def test_modules_that_enable_guest_uprobe_events_are_found() -> None:
    assert "test_uprobe_inguest.py" in ENABLING
    assert all((VM / name).exists() for name in HOOKED)


@pytest.mark.parametrize("name", ENABLING)
def test_a_module_that_enables_guest_uprobe_events_boots_on_one_tcg_thread(name: str) -> None:
    assert one_tcg_thread(ast.parse((VM / name).read_text())), name
