"""The package's import structure, read from the source with ``ast`` (nothing is imported).

Every import counts: module-level and function-level ``import``/``from ... import``, relative
ones, and ``importlib.import_module("literal")``; names a package re-exports (eagerly in its
``__init__`` or lazily through a ``{name: module}`` table) count as imports of the module that
defines them. Imports under ``if TYPE_CHECKING:`` do not run and do not count.

Checked: (a) no import cycle between redraft's modules; (b) the layering rule of
docs/architecture.md: a stage imports only the shared modules and the stages to its left,
``models -> data, hub -> train, ngrams -> infer -> serve, vllm -> bench -> demo, entry ->
commands``, with the exceptions listed here; and production code never imports ``redraft.testing``;
(c) inside ``redraft.infer``, the rooms' order ``runner -> spec -> engine, drafters -> the
facade``, with ``TYPE_CHECKING`` imports counted too (an annotation that names an upper room is a
dependency on it), and no cycle between infer's modules even then.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "redraft"

# The layers, left to right; a module may import its own stage, the shared modules and the
# stages of lower layers. Stages in one layer do not import each other.
SHARED = {
    "redraft",
    "redraft.errors",
    "redraft.utils",
    "redraft.resources",
    "redraft.hub.resolve",  # the hub package's loading half: every stage resolves artifacts
    "redraft.hub.card",
    "redraft.settings",
    "redraft.setting_types",
    "redraft.cli",
}
LAYERS = [
    {"models"},
    {"data", "hub"},  # data tokenizes with the target's tokenizer; hub's push checks a drafter
    {"train", "ngrams"},
    {"infer"},
    {"serve", "vllm"},  # what users run: redraft's server, redraft's drafters inside vLLM
    {"bench"},  # redraft-bench: redraft's engine beside Hugging Face's and vLLM's
    # make demo: builds tables, trains, decodes; entry: the console scripts of data and train
    # that self-distill, run with infer's engine injected (redraft.data.replies.use_replies)
    {"demo", "entry"},
    {"commands"},  # `redraft <command>`: imports each command's module when it runs
    {"__main__"},  # python -m redraft
]
# Allowed imports beyond the layers, each with its reason.
EXCEPTIONS = {
    # `import redraft` installs the Auto-class hook (redraft/models/auto.py imports no torch)
    ("redraft", "redraft.models.auto"),
    # `redraft-vllm replay --results-dir` files its table as redraft-bench's result files
    ("redraft.vllm.cli", "redraft.bench.results"),
}
# Test support: may import anything; production code never imports it.
TEST_SUPPORT = {"redraft.testing"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _walk_runtime(tree: ast.AST, typing: bool = False):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks (with
    ``typing``: every node)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                not typing
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _absolute(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def exports(package: str) -> dict[str, str]:
    """``{name: defining module}`` of what ``package``'s ``__init__`` re-exports, eagerly
    (``from .x import name``) or lazily (a dict literal of ``name: module`` strings)."""
    tree = ast.parse(modules()[package].read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            source = _absolute(package, node)
            for alias in node.names:
                if source in modules():
                    found[alias.asname or alias.name] = source
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if (
                    isinstance(k, ast.Constant)
                    and isinstance(v, ast.Constant)
                    and isinstance(v.value, str)
                ):
                    target = v.value if v.value.startswith("redraft") else f"{package}.{v.value}"
                    if target in modules():
                        found[k.value] = target
    return found


def _resolve(module: str, name: str | None) -> str | None:
    """The redraft module that ``from module import name`` (or ``import module``) loads."""
    if module not in modules():
        return None
    if name is None:
        return module
    if f"{module}.{name}" in modules():
        return f"{module}.{name}"
    if _is_package(module) and name in exports(module):
        return exports(module)[name]
    return module


@cache
def imports(name: str, typing: bool = False) -> frozenset[str]:
    """The redraft modules that module ``name`` imports, at any level of its code (with
    ``typing``: its ``TYPE_CHECKING`` imports too)."""
    tree = ast.parse(modules()[name].read_text())
    found = set()
    for node in _walk_runtime(tree, typing):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name, None) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, node)
            found |= {_resolve(source, a.name) for a in node.names}
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(_resolve(node.args[0].value, None))
    if _is_package(name):  # a lazy export table is an import on first use
        found |= set(exports(name).values())
    return frozenset(found - {None, name})


def _cycles(names=None, typing: bool = False) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over ``names``
    (default: every module)."""
    names = set(modules()) if names is None else set(names)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in imports(v, typing) & names:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(names):
        if v not in index:
            visit(v)
    return out


def stage(name: str) -> str | None:
    """``models``, ``data``, ..., ``hub``, ``demo``; None for shared modules and test support."""
    if name in SHARED or name in TEST_SUPPORT:
        return None
    return name.split(".")[1]


def layer(name: str) -> int:
    s = stage(name)
    return next(i for i, group in enumerate(LAYERS) if s in group)


def test_the_import_reader_sees_every_kind_of_import():
    # a function-level import, a lazy package export, importlib with a literal, TYPE_CHECKING
    assert "redraft.models.redrafter" in imports("redraft.hub.push")  # inside check_finished
    assert "redraft.ngrams.tables" in imports("redraft.ngrams")  # the lazy _EXPORTS table
    assert "redraft.hub.push" in imports("redraft.hub")
    assert "redraft.infer.decoder" in imports("redraft.infer")  # _WHERE, module names relative
    assert "redraft.hub.resolve" in imports("redraft.models.drafter_io")  # importlib.import_module
    assert "redraft.models.redrafter" not in imports("redraft.models.apple")  # TYPE_CHECKING only
    assert exports("redraft.data")["heldout_prompts"] == "redraft.data.prompts"  # eager re-export


def test_no_import_cycle_between_redraft_modules():
    assert _cycles() == []


def test_every_module_has_a_place_in_the_layers():
    for name in modules():
        if stage(name) is not None:
            assert any(stage(name) in group for group in LAYERS), name


@pytest.mark.parametrize("name", sorted(modules()))
def test_a_module_imports_only_shared_modules_and_stages_to_its_left(name):
    bad = []
    for dep in sorted(imports(name)):
        if (name, dep) in EXCEPTIONS or dep in SHARED:
            continue
        if dep in TEST_SUPPORT:
            if name not in TEST_SUPPORT:
                bad.append(f"{dep} (test support; production code never imports it)")
            continue
        if name in TEST_SUPPORT:
            continue
        if stage(name) is None:
            bad.append(f"{dep} (a shared module imports only shared modules)")
        elif stage(dep) != stage(name) and layer(dep) >= layer(name):
            bad.append(f"{dep} (stage {stage(dep)!r} is not to the left of {stage(name)!r})")
    assert bad == [], f"{name} imports {bad}"


# Inside redraft.infer: the rooms, lowest first. A module imports its own room, the shared
# modules of infer and the rooms of lower levels; rooms of one level do not import each other.
INFER_SHARED = {"redraft.infer.config", "redraft.infer.stats"}  # settings and output types
INFER_ROOMS = [
    {"runner"},  # the target's forwards: verifier, KV cache, graphs, attention, cost curve
    {"spec"},  # the speculator, the drafter interface, acceptance, gate, host kernels
    {"engine", "drafters"},  # continuous batching; the drafters (they implement spec's interface)
    {"facade"},  # redraft.infer itself, decoder, loader, replies: what users import
]


def room(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 3 and parts[2] in {r for level in INFER_ROOMS for r in level}:
        return parts[2]
    return "facade"


def room_level(name: str) -> int:
    return next(i for i, level in enumerate(INFER_ROOMS) if room(name) in level)


INFER = sorted(n for n in modules() if n == "redraft.infer" or n.startswith("redraft.infer."))


def test_every_infer_module_has_a_room():
    assert {room(n) for n in INFER} == {r for level in INFER_ROOMS for r in level}
    assert room("redraft.infer.runner.verify") == "runner" and room("redraft.infer") == "facade"
    assert room("redraft.infer.engine") == "engine"  # a room's package is in the room


def test_no_import_cycle_inside_infer_even_counting_type_checking_imports():
    assert _cycles(INFER, typing=True) == []


@pytest.mark.parametrize("name", [n for n in INFER if n not in INFER_SHARED])
def test_an_infer_module_imports_only_its_room_and_rooms_below(name):
    bad = []
    for dep in sorted(imports(name, typing=True)):
        if dep not in INFER or dep in INFER_SHARED or room(dep) == room(name):
            continue
        if room_level(dep) >= room_level(name):
            bad.append(f"{dep} (room {room(dep)!r} is not below {room(name)!r})")
    assert bad == [], f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(INFER_SHARED))
def test_infer_shared_modules_import_no_room(name):
    assert {d for d in imports(name, typing=True) if d in INFER} - INFER_SHARED == set()


@pytest.mark.parametrize("package", ["redraft.infer", "redraft.hub", "redraft.data"])
def test_every_public_name_of_a_package_resolves(package):
    """A lazy export table names modules by path: one that moved must move in the table too."""
    import importlib

    mod = importlib.import_module(package)
    for name in getattr(mod, "__all__", ()):
        assert getattr(mod, name) is not None, f"{package}.{name}"
    assert set(exports(package).values()) <= set(modules()), exports(package)
