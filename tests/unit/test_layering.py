"""Imports run downward and never in a circle: the package's layering, checked from the source.

Every import counts, including those under ``TYPE_CHECKING`` and inside
functions: a circle of type-only imports is still two modules that cannot be
read, or changed, one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qprobe"

# Top to bottom; a module may import its own layer and the layers below it.  The guide's order is
# front ends -> api -> events -> core -> kernel -> vmm -> arch -> errors; what the code also needs:
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The package's __init__ re-exports the API, so it sits with the front ends (and, with the pytest
    # plugin, its parts in qprobe.plugin and pytest_lacks).
    (
        "front ends",
        (
            "qprobe",
            "qprobe.cli",
            "qprobe.shell",
            "qprobe.pytest_plugin",
            "qprobe.plugin",
            "qprobe.pytest_lacks",
            "qprobe.bench",
            "qprobe.demo",
        ),
    ),
    # session makes Targets (boot, attach) above the class they make; wiring puts a Target's parts
    # (parts) together (bootprobes as the kernel boots); probeapi and eventapi (the kprobes and kprobe_events
    # APIs), guest, views and lifetime are the objects its methods are forwarded (facade) or hand work to.
    (
        "api",
        (
            "qprobe.api",
            "qprobe.session",
            "qprobe.probeapi",
            "qprobe.eventapi",
            "qprobe.wiring",
            "qprobe.bootprobes",
            "qprobe.guest",
            "qprobe.views",
            "qprobe.lifetime",
            "qprobe.facade",
            "qprobe.parts",
        ),
    ),
    # The events package: kprobe_events definitions (define, kprobe, event...), and beside them funcs
    # ("can this function be probed", also for `qprobe funcs`), modules (module events re-registered as
    # their module loads) and timeline (hits handed on in the guest's order).
    ("events", ("qprobe.events",)),
    ("core", ("qprobe.core",)),
    ("kernel", ("qprobe.kernel",)),
    # images build and cache what a target boots; api and the CLI use them, nothing below does.
    ("vmm", ("qprobe.vmm", "qprobe.images")),
    ("arch", ("qprobe.arch",)),
    # The kprobe_events language: pure functions over text and a FetchContext protocol.
    ("fetch", ("qprobe.fetch",)),
    ("errors", ("qprobe.errors", "qprobe.paths")),
)


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The qprobe modules ``name`` imports (a submodule when one is named, else its package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs if len(subs) == len(node.names) else [base, *subs])
    return {m for m in found if m in known and m != name}


def layer(name: str) -> int:
    """The layer's rank (0 is the top); the longest prefix in LAYERS decides."""
    best, rank = "", -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank >= 0, f"{name} is in no layer of LAYERS"
    return rank


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_module_has_a_layer() -> None:
    for name in GRAPH:
        layer(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_run_downward(name: str) -> None:
    upward = sorted(m for m in GRAPH[name] if layer(m) < layer(name))
    assert not upward, f"{name} ({LAYERS[layer(name)][0]}) imports from above: " + ", ".join(
        f"{m} ({LAYERS[layer(m)][0]})" for m in upward
    )


# The architecture's own packages (qprobe.arch.<name>) and the one module that names them all,
# qprobe.arch.select (wiring.py, the composition root, asks it for an Arch by the target's architecture).
# Everything else sees an architecture only through qprobe.arch's interface and its neutral modules.
ARCH_PACKAGES = ("qprobe.arch.x86_64", "qprobe.arch.arm64")
ARCH_CHOOSER = "qprobe.arch.select"


def architecture_specific(name: str) -> bool:
    """Whether module ``name`` belongs to one architecture (the chooser counts: it names them all)."""
    return name == ARCH_CHOOSER or any(name == p or name.startswith(p + ".") for p in ARCH_PACKAGES)


def test_every_architecture_package_is_listed() -> None:
    """A new qprobe/arch/<name>/ package is architecture-specific without anyone remembering to say so."""
    found = {".".join(path.relative_to(PACKAGE.parent).parts) for path in (PACKAGE / "arch").iterdir()
             if path.is_dir() and (path / "__init__.py").exists()}  # fmt: skip
    assert found == set(ARCH_PACKAGES)


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("qprobe") and not architecture_specific(n)))
def test_only_the_arch_packages_know_an_architecture(name: str) -> None:
    """Every module outside qprobe/arch/<name>/ talks to an architecture only through qprobe.arch's interface.

    The exception is wiring.py, which asks qprobe.arch.select for the target's Arch; it imports no
    architecture's package itself.
    """
    allowed = {ARCH_CHOOSER} if name == "qprobe.wiring" else set()
    arch = sorted(m for m in GRAPH[name] if architecture_specific(m) and m not in allowed)
    assert not arch, f"{name} imports {', '.join(arch)}"


def test_the_neutrality_check_sees_an_architecture_import(tmp_path: Path) -> None:
    """kernel/ importing an arch package, or anything but wiring importing the chooser, is caught."""
    assert architecture_specific("qprobe.arch.x86_64.tsc") and architecture_specific(ARCH_CHOOSER)
    assert not architecture_specific("qprobe.arch") and not architecture_specific("qprobe.arch.inguest")
    pkg = tmp_path / "qprobe"
    (pkg / "kernel").mkdir(parents=True)
    (pkg / "kernel" / "clock.py").write_text("from qprobe.arch.x86_64.tsc import after_rdtsc\n")
    known = {"qprobe.kernel.clock": pkg / "kernel" / "clock.py", "qprobe.arch.x86_64.tsc": pkg / "tsc.py"}
    assert imports("qprobe.kernel.clock", known["qprobe.kernel.clock"], known) == {"qprobe.arch.x86_64.tsc"}


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components: any with more than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The two checks on a made-up package: the parser finds relative, aliased and function-level imports."""
    pkg = tmp_path / "qprobe"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from . import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from qprobe.core.a import x\n    import qprobe.api as api\n")
    (pkg / "api.py").write_text("")
    known = {"qprobe": pkg / "__init__.py", "qprobe.core": pkg / "core" / "__init__.py", "qprobe.api": pkg / "api.py",
             "qprobe.core.a": pkg / "core" / "a.py", "qprobe.core.b": pkg / "core" / "b.py"}  # fmt: skip
    assert imports("qprobe.core.a", known["qprobe.core.a"], known) == {"qprobe.core.b"}
    assert imports("qprobe.core.b", known["qprobe.core.b"], known) == {"qprobe.core.a", "qprobe.api"}
    assert layer("qprobe.api") < layer("qprobe.core.b")
