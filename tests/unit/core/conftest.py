"""The core's unit tests drive a real GdbRemote against tests/unit/vmm's scripted QEMU gdbstub."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vmm"))
