"""aruntime's layers: no import cycle, and no import from a lower layer into a higher one.

The imports are read with :mod:`ast` by ``docs/build_architecture.py`` (which also draws the package
diagram from them): nothing is imported, imports inside functions count, and imports under
``if TYPE_CHECKING:`` do not. :data:`LAYERS` is the one place the layer order is written; a module
imports only from its own layer and the layers below. The modules kept at their old paths for one
release (:data:`RETIRED`) belong to no layer: each only re-exports its new home, and no module of
aruntime imports one.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("aruntime._version", "aruntime.errors", "aruntime.helpers", "aruntime.events", "aruntime.dtype")),
    ("memory", ("aruntime.memory",)),
    ("compile", ("aruntime.compile",)),
    ("engine", ("aruntime.engine",)),
    ("device", ("aruntime.device",)),
    ("backends", ("aruntime.backends",)),
    ("scheduling", ("aruntime.scheduler", "aruntime.graph", "aruntime.batching")),
    ("profile", ("aruntime.profile",)),
    ("command line", ("aruntime", "aruntime.__main__", "aruntime.cli", "aruntime.check", "aruntime.demo")),
]
"""The layers, lowest first, each with the modules and packages it holds (a package: all its modules)."""

RETIRED: dict[str, tuple[str, ...]] = {
    "aruntime.allocator": ("aruntime.memory.allocator",),
    "aruntime.buffer": ("aruntime.memory.buffer",),
    "aruntime.dlpack": ("aruntime.memory.dlpack", "aruntime.memory.buffer"),
    "aruntime.hazards": ("aruntime.memory.hazards",),
    "aruntime.compiler": ("aruntime.compile.compiler",),
    "aruntime.cc": ("aruntime.compile.cc",),
    "aruntime.compile_cache": ("aruntime.compile.cache",),
    "aruntime.profile.align": ("aruntime.engine.clock",),
}
"""Old module path -> the modules it re-exports (the only imports it may have), until the next release."""


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_architecture", ROOT / "docs" / "build_architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_architecture", module)
    spec.loader.exec_module(module)
    return module


BUILD = _builder()
GRAPH: dict[str, set[str]] = BUILD.imports(ROOT)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (the most specific entry that holds it)."""
    best: tuple[int, int] | None = None
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            holds = module == member or (member != "aruntime" and module.startswith(member + "."))
            if holds and (best is None or len(member) > best[0]):
                best = (len(member), index)
    return None if best is None else best[1]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_finds_the_package() -> None:
    assert {"aruntime", "aruntime.device.base", "aruntime.engine.ops", "aruntime.memory.buffer"} <= set(GRAPH)
    assert (
        "aruntime.memory.buffer" in GRAPH["aruntime.device.base"] or "aruntime.memory" in GRAPH["aruntime.device.base"]
    )


def test_every_module_has_a_layer() -> None:
    lost = sorted(m for m in GRAPH if m not in RETIRED and layer_of(m) is None)
    assert not lost, f"modules in no layer (add them to LAYERS in tests/test_layers.py): {lost}"


def test_no_import_cycle() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m not in RETIRED))
def test_no_import_from_a_higher_layer(module: str) -> None:
    mine = layer_of(module)
    assert mine is not None
    for target in sorted(GRAPH[module]):
        assert target not in RETIRED, f"{module} imports {target}, an old path kept for users: import its new home"
        theirs = layer_of(target)
        assert theirs is not None and theirs <= mine, (
            f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0] if theirs is not None else '?'}), "
            "a higher layer: pass a callback in or register it instead"
        )


@pytest.mark.parametrize("old", sorted(RETIRED))
def test_an_old_path_only_reexports_its_new_home(old: str) -> None:
    assert old in GRAPH, f"{old} is listed in RETIRED but does not exist"
    assert GRAPH[old] == set(RETIRED[old]), f"{old} imports {sorted(GRAPH[old])}, not only {RETIRED[old]}"


def test_the_check_catches_a_cycle_and_an_upward_import() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("aruntime.memory.buffer") == 1
    assert layer_of("aruntime.device.base") == 4
    assert layer_of("aruntime") == len(LAYERS) - 1
    assert layer_of("aruntime.nowhere") is None


def test_type_checking_imports_and_function_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "aruntime"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from aruntime.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aruntime import sub\n"
        "def f():\n    from aruntime import low\n    from . import other\n"
    )
    (pkg / "sub" / "other.py").write_text("import aruntime.low\n")
    graph = BUILD.imports(tmp_path)
    assert graph["aruntime.sub"] == {"aruntime.sub.leaf"}
    assert graph["aruntime.sub.leaf"] == {"aruntime.low", "aruntime.sub.other"}  # not the TYPE_CHECKING one
    assert graph["aruntime.sub.other"] == {"aruntime.low"}


@pytest.mark.parametrize("old", sorted(RETIRED))
def test_an_old_path_still_imports_with_a_warning(old: str) -> None:
    code = textwrap.dedent(f"""
        import importlib, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module({old!r})
        assert any(w.category is DeprecationWarning and {old!r} in str(w.message) for w in caught), caught
        homes = [importlib.import_module(m) for m in {RETIRED[old]!r}]
        for name in old.__all__:
            assert any(getattr(home, name, None) is getattr(old, name) for home in homes), name
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
