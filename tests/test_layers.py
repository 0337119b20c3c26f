"""The layer rule of docs/design.md ("## Layers"), checked statically with ``ast``.

The layer table is the fenced ```` ```layers ```` block at the end of docs/design.md: one line
per layer, ``<number> <label>: <unit> <unit> ...``, where a unit is a top-level module or
package directly under ``casstore/`` (``__init__`` is ``casstore/__init__.py``) and every
submodule of a package belongs to its package's layer.  Nothing is imported: each module's
source is parsed, so the checks hold for code paths no test runs.

What is checked (each test's failure message says what to change):

1. every unit under ``casstore/`` is placed in the table (a new module must be given a layer);
2. no runtime import goes to a higher layer: top-level imports, imports inside functions
   ("lazy" imports, which only hide a dependency, they do not remove it) and
   ``importlib.import_module("casstore...")`` alike;
3. within the ``features`` layer, no feature unit imports another one at runtime: what two
   features share goes down a layer;
4. there is no import cycle among casstore modules at runtime (lazy imports included), at
   module granularity; importing ``casstore.a.b`` also runs ``casstore/a/__init__.py``, so
   that edge counts too (the root ``casstore/__init__.py`` excepted: it is always already
   being imported when any submodule runs);
5. no module imports a private name (``_x``) from another module, or touches a private
   attribute (``expr._x``) that its own source does not define, except on ``self``/``cls``/
   ``super()``, with an explicit, justified allowlist for the standard library;
6. the table has no stale entry (every unit it names exists) and names every unit once.

Type-only imports (under ``if TYPE_CHECKING:``) never execute, so they are not runtime edges:
they are left out of checks 2-4 and may point upward (a feature may annotate ``store: Store``
with ``from ..store import Store`` under ``TYPE_CHECKING``, as the plan in issue 10 asks).
They are allowed to do that only as long as they do not create a runtime cycle, which holds
exactly when the imported names are never used at runtime: a runtime use would need a
runtime import, and that import is the upward edge or the cycle the rule forbids.  So
``test_type_only_imports_stay_type_only`` checks that a type-only import that would break
the rule (upward, across features, or closing a runtime cycle) binds names used only in
annotations (which ``from __future__ import annotations`` keeps unevaluated; without it a
function's annotations run at definition time and count as runtime uses) or string literals.
The same test reports any other name imported under ``TYPE_CHECKING`` and used at runtime:
that line raises NameError, and mypy cannot see it (it treats ``TYPE_CHECKING`` as true).

Known limits, on purpose: ``getattr(obj, name)`` with a computed name is invisible; an
attribute ``x._a`` is allowed when the module defines ``_a`` itself (on a class body, a
``__slots__`` entry or an ``obj._a = ...`` assignment), unless ``x`` is a module alias or a
parameter annotated with a class imported from another casstore module.

Run ``python tests/test_layers.py`` to print every violation at once.  The ``selftest_``
tests run each checker on small synthetic packages and prove it reports what it must.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "casstore"
DESIGN = ROOT / "docs" / "design.md"
FEATURES = "features"  # the label of the layer whose units must not import each other

# Private names of other modules that casstore may use, as (module, name).  Keep it short and
# say why each one is safe: a private name can change in any release of its owner.  (casstore
# uses none of these today; they are the standard-library names that are private in spelling
# only, listed so that a legitimate use does not need a change to this test.)
ALLOWED_PRIVATE_MODULE_ATTRS: FrozenSet[Tuple[str, str]] = frozenset({
    # os._exit: documented (os docs, "Process Management") as the way to leave a forked child
    # without running the parent's atexit handlers or flushing its stdio buffers a second time.
    ("os", "_exit"),
    # sys._getframe: documented in the sys module as a CPython implementation detail, unchanged
    # for decades; acceptable for naming a caller in a diagnostic, never for control flow.
    ("sys", "_getframe"),
})
# Attribute names that are public API despite the underscore, whatever object they are read
# from: collections.namedtuple prefixes its methods and fields tuple with "_" precisely so
# they cannot clash with field names (collections docs: _make, _asdict, _replace, _fields,
# _field_defaults).
ALLOWED_PRIVATE_ATTRS: FrozenSet[str] = frozenset({"_make", "_asdict", "_replace", "_fields", "_field_defaults"})


# -- the model -----------------------------------------------------------------------------------


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` (name-mangled) are private; dunders like ``__init__`` are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Import:
    """One import of a casstore module, as written (or implied) in ``src``."""

    src: str  # importing module, dotted
    dst: str  # imported module, dotted (a casstore module, existing or not)
    path: str  # file of src, for messages
    line: int
    kind: str  # "top-level", "lazy" or "type-only"
    where: Optional[str] = None  # enclosing function, for lazy imports
    implicit: bool = False  # a parent package's __init__ run by importing a submodule
    dynamic: bool = False  # importlib.import_module with a constant name

    @property
    def runtime(self) -> bool:
        return self.kind != "type-only"

    def describe(self) -> str:
        how = "type-only import" if self.kind == "type-only" else (
            f"lazy import in {self.where}()" if self.kind == "lazy" else "top-level import")
        if self.dynamic:
            how = "importlib.import_module " + ("call" if self.kind == "top-level" else f"in {self.where}()")
        if self.implicit:
            how += ", which first runs this package's __init__"
        return f"{self.path}:{self.line} ({how})"


@dataclass
class Module:
    """One parsed module of the package."""

    name: str  # dotted: casstore, casstore.store, casstore.objects.local
    path: str  # repo-relative file path
    unit: str  # top-level unit under casstore/: "__init__", "store", "objects"
    is_package: bool
    tree: ast.Module
    imports: List[Import] = field(default_factory=list)


@dataclass
class Package:
    """Every module of a package, with its imports resolved."""

    modules: Dict[str, Module]
    namespace_dirs: List[str]  # sub-directories holding modules but no __init__.py
    shadowed: List[str]  # a module and a package of the same name (the package wins)
    dynamic_unresolved: List[str]  # messages: importlib calls on names we cannot read

    @property
    def units(self) -> Set[str]:
        return {m.unit for m in self.modules.values()}

    def imports(self) -> Iterator[Import]:
        for m in self.modules.values():
            yield from m.imports


def unit_of(dotted: str) -> str:
    parts = dotted.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def module_name(relpath: str) -> Tuple[str, bool]:
    """``casstore/objects/local.py`` -> (``casstore.objects.local``, False); ``__init__`` -> package."""
    parts = relpath[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def read_sources(root: Path = ROOT, pkg: str = PKG) -> Dict[str, str]:
    """``{repo-relative path: source}`` for every ``.py`` file under ``root/pkg``."""
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted((root / pkg).rglob("*.py")) if "__pycache__" not in p.parts}


def is_type_checking(test: ast.expr) -> Optional[bool]:
    """True for ``TYPE_CHECKING`` / ``typing.TYPE_CHECKING``, False for ``not TYPE_CHECKING``, else None."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and is_type_checking(test.operand):
        return False
    return None


def _is_import_module_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module"
            and isinstance(f.value, ast.Name) and f.value.id == "importlib") or \
        (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def scan(sources: Mapping[str, str], pkg: str = PKG) -> Package:
    """Parse every module and resolve its imports of ``pkg`` modules."""
    modules: Dict[str, Module] = {}
    shadowed: List[str] = []
    for relpath, src in sorted(sources.items()):
        name, is_pkg = module_name(relpath)
        if name in modules:
            a, b = sorted((modules[name].path, relpath))
            shadowed.append(f"{a} and {b} both define module {name} (the package shadows the module; "
                            "delete the leftover)")
            if not is_pkg:
                continue
        modules[name] = Module(name, relpath, unit_of(name), is_pkg, ast.parse(src, filename=relpath))
    dirs = {m.name.rsplit(".", 1)[0] for m in modules.values() if not m.is_package and "." in m.name}
    namespace_dirs = sorted(d for d in dirs if d not in modules and d != pkg)
    known = set(modules) | set(namespace_dirs)
    package = Package(modules, [d.replace(".", "/") + "/" for d in namespace_dirs], shadowed, [])
    for m in modules.values():
        m.imports = list(_collect_imports(m, known, pkg, package.dynamic_unresolved))
    return package


def _resolve_base(m: Module, level: int, modname: Optional[str]) -> Optional[str]:
    if level == 0:
        return modname
    pkg_parts = m.name.split(".") if m.is_package else m.name.split(".")[:-1]
    if level - 1 >= len(pkg_parts):
        return None  # beyond the top-level package: an ImportError at runtime
    base = pkg_parts[: len(pkg_parts) - (level - 1)]
    return ".".join(base + ([modname] if modname else []))


def _in_pkg(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def _collect_imports(m: Module, known: Set[str], pkg: str, unresolved: List[str]) -> Iterator[Import]:
    def make(dst: str, node: ast.AST, kind: str, where: Optional[str], dynamic: bool = False) -> Iterator[Import]:
        line = getattr(node, "lineno", 0)
        yield Import(m.name, dst, m.path, line, kind, where, dynamic=dynamic)
        # Importing a.b.c runs a/b/__init__.py first (unless it is an ancestor of the importer,
        # which is already being imported when the importer runs, or the root package).
        parts = dst.split(".")
        for i in range(len(parts) - 1, 1, -1):
            parent = ".".join(parts[:i])
            if parent in known and not m.name.startswith(parent + ".") and parent != m.name:
                yield Import(m.name, parent, m.path, line, kind, where, implicit=True, dynamic=dynamic)

    def walk(node: ast.AST, where: Optional[str], type_only: bool, scope: str) -> Iterator[Import]:
        kind = "type-only" if type_only else ("lazy" if where else "top-level")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_pkg(alias.name, pkg):
                    yield from make(alias.name, node, kind, where)
            return
        if isinstance(node, ast.ImportFrom):
            base = _resolve_base(m, node.level, node.module)
            if base is None or not _in_pkg(base, pkg):
                return
            targets: List[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    targets.append(sub)  # ``from . import errors``: the submodule itself
                elif base not in targets:
                    targets.append(base)
            for t in targets:
                yield from make(t, node, kind, where)
            return
        if isinstance(node, ast.If):
            tc = is_type_checking(node.test)
            if tc is not None:
                for n in node.body:
                    yield from walk(n, where, type_only or tc, scope)
                for n in node.orelse:
                    yield from walk(n, where, type_only or not tc, scope)
                return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            name = node.name if not isinstance(node, ast.Lambda) else "<lambda>"
            qual = f"{scope}.{name}" if scope else name
            for d in getattr(node, "decorator_list", []):
                yield from walk(d, where, type_only, scope)
            yield from walk(node.args, where, type_only, scope)
            body: List[ast.AST] = list(node.body) if isinstance(node.body, list) else [node.body]
            for stmt in body:
                yield from walk(stmt, qual, type_only, qual)
            return
        if isinstance(node, ast.ClassDef):
            qual = f"{scope}.{node.name}" if scope else node.name
            for child in ast.iter_child_nodes(node):
                yield from walk(child, where, type_only, qual)
            return
        if isinstance(node, ast.Call) and _is_import_module_call(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name.startswith("."):
                    dots = len(name) - len(name.lstrip("."))
                    name = _resolve_base(m, dots, name.lstrip(".") or None) or ""
                if _in_pkg(name, pkg):
                    yield from make(name, node, kind, where, dynamic=True)
            elif isinstance(arg, ast.JoinedStr):
                head = arg.values[0] if arg.values else None
                text = head.value if isinstance(head, ast.Constant) and isinstance(head.value, str) else ""
                if text.startswith(pkg) or text.startswith("."):
                    unresolved.append(
                        f"{m.path}:{node.lineno}: importlib.import_module(f{ast.unparse(arg)[1:]}) imports a "
                        f"{pkg} module whose name is computed, so no check can see the dependency; import the "
                        "modules explicitly (e.g. a tuple of modules, or a registry filled by plain imports)")
        for child in ast.iter_child_nodes(node):
            yield from walk(child, where, type_only, scope)

    for stmt in m.tree.body:
        yield from walk(stmt, None, False, "")


# -- the layer table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    number: int
    label: str
    units: Tuple[str, ...]


@dataclass
class Table:
    layers: List[Layer]
    errors: List[str]  # malformed lines, duplicates

    def layer_of(self, unit: str) -> Optional[Layer]:
        for layer in self.layers:
            if unit in layer.units:
                return layer
        return None


_LINE = re.compile(r"^\s*(\d+)\s+([A-Za-z][\w-]*)\s*:\s*(.*?)\s*$")


def parse_table(text: str, where: str = "docs/design.md") -> Table:
    """Read the one ```` ```layers ```` fenced block of ``text``."""
    blocks = re.findall(r"^```layers[ \t]*\n(.*?)^```", text, flags=re.S | re.M)
    if len(blocks) != 1:
        return Table([], [f"{where} must hold exactly one ```layers fenced block (found {len(blocks)}); "
                          "write it under '## Layers' at the end of the file"])
    layers: List[Layer] = []
    errors: List[str] = []
    seen: Dict[str, int] = {}
    for raw in blocks[0].splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        mt = _LINE.match(line)
        if not mt:
            errors.append(f"{where}: layers line {raw!r} is not '<number> <label>: <unit> <unit> ...'")
            continue
        num, label, units = int(mt.group(1)), mt.group(2), tuple(mt.group(3).split())
        for u in units:
            if u in seen:
                errors.append(f"{where}: unit {u!r} is listed in layer {seen[u]} and again in layer {num}; "
                              "keep one")
            seen[u] = num
        layers.append(Layer(num, label, units))
    nums = [layer.number for layer in layers]
    if nums != sorted(set(nums)):
        errors.append(f"{where}: layer numbers {nums} must be unique and increasing, lowest layer first")
    labels = [layer.label for layer in layers]
    if len(set(labels)) != len(labels):
        errors.append(f"{where}: layer labels {labels} must be unique")
    return Table(layers, errors)


# -- the checks (each returns a list of messages; empty = fine) -------------------------------------


def check_placed(package: Package, table: Table) -> List[str]:
    """Check 1: every unit found under casstore/ has a layer, and the tree is unambiguous."""
    out = list(package.shadowed)
    for d in package.namespace_dirs:
        out.append(f"{d} holds modules but no __init__.py (an implicit namespace package, which a "
                   f"same-named .py module would silently shadow); add {d}__init__.py")
    for unit in sorted(package.units):
        if table.layer_of(unit) is None:
            files = sorted(m.path for m in package.modules.values() if m.unit == unit)
            out.append(f"{PKG} unit {unit!r} ({', '.join(files)}) has no layer: add it to the ```layers block in "
                       "docs/design.md (the lowest layer whose modules it needs), or delete it if it is a leftover")
    return out


def check_table_current(package: Package, table: Table) -> List[str]:
    """Check 6: every unit the table names exists, so the table is the module map as built."""
    out = list(table.errors)
    units = package.units
    for layer in table.layers:
        for u in layer.units:
            if u not in units:
                out.append(f"docs/design.md layer {layer.number} {layer.label} names {u!r}, but there is no "
                           f"{PKG}/{u}.py or {PKG}/{u}/: remove the stale entry (or create the module)")
    if not any(layer.label == FEATURES for layer in table.layers):
        out.append(f"docs/design.md has no layer labelled {FEATURES!r}: the feature-independence rule needs it")
    return out


def check_upward(package: Package, table: Table) -> List[str]:
    """Check 2: no runtime import (top-level, lazy or importlib) of a higher layer, or of a missing module."""
    out = list(package.dynamic_unresolved)
    known = set(package.modules) | {d.rstrip("/").replace("/", ".") for d in package.namespace_dirs}
    for imp in package.imports():
        if imp.implicit:
            continue
        if imp.dst not in known:
            out.append(f"{imp.describe()}: imports {imp.dst}, which does not exist; fix the import")
            continue
        if not imp.runtime:
            continue
        src_l, dst_l = table.layer_of(unit_of(imp.src)), table.layer_of(unit_of(imp.dst))
        if src_l is None or dst_l is None:
            continue  # check_placed reports the unplaced unit
        if dst_l.number > src_l.number:
            out.append(
                f"{imp.describe()}: {imp.src} (layer {src_l.number} {src_l.label}) imports {imp.dst} "
                f"(layer {dst_l.number} {dst_l.label}); layers import only downward: take the lower-layer "
                f"object you need as a parameter, or move the shared code down to layer {src_l.number} or "
                "below (an annotation-only import may go under `if TYPE_CHECKING:`)")
    return out


def check_features_independent(package: Package, table: Table) -> List[str]:
    """Check 3: no feature unit imports another feature unit at runtime."""
    out: List[str] = []
    feats = next((set(layer.units) for layer in table.layers if layer.label == FEATURES), set())
    for imp in package.imports():
        if not imp.runtime or imp.implicit:
            continue
        a, b = unit_of(imp.src), unit_of(imp.dst)
        if a in feats and b in feats and a != b:
            out.append(f"{imp.describe()}: feature {a!r} imports feature {b!r} ({imp.dst}); features do not "
                       "import each other: move what both need down to layers 0-3, or let the facade "
                       "(store.py) combine them")
    return out


def runtime_graph(package: Package) -> Dict[str, Dict[str, Import]]:
    """``{src: {dst: first runtime Import}}`` over existing modules (self-imports dropped)."""
    g: Dict[str, Dict[str, Import]] = {name: {} for name in package.modules}
    for imp in package.imports():
        if imp.runtime and imp.dst in package.modules and imp.dst != imp.src:
            prev = g[imp.src].get(imp.dst)
            if prev is None or (prev.implicit and not imp.implicit) or \
                    (prev.implicit == imp.implicit and prev.line > imp.line):
                g[imp.src][imp.dst] = imp
    return g


def strongly_connected(g: Mapping[str, Iterable[str]]) -> List[List[str]]:
    """Tarjan's SCCs (iterative), each sorted; only those that hold a cycle (size > 1)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def _shortest_path(g: Mapping[str, Mapping[str, Import]], a: str, b: str, allowed: Set[str]) -> Optional[List[str]]:
    prev: Dict[str, str] = {a: a}
    q = deque([a])
    while q:
        v = q.popleft()
        if v == b:
            path = [b]
            while path[-1] != a:
                path.append(prev[path[-1]])
            return path[::-1]
        for w in sorted(g[v]):
            if w in allowed and w not in prev:
                prev[w] = v
                q.append(w)
    return None


def find_cycles(package: Package, max_per_group: int = 40) -> List[str]:
    """Check 4: runtime import cycles, one message per cycle, each edge with file:line.

    For every strongly connected group of modules, the shortest cycle through each of its
    import edges is reported (deduplicated), so every edge that keeps the group tangled is
    named; cutting edges until the group falls apart fixes it.
    """
    g = runtime_graph(package)
    out: List[str] = []
    for comp in strongly_connected(g):
        members = set(comp)
        cycles: Dict[Tuple[str, ...], List[str]] = {}
        for u in comp:
            for v in sorted(g[u]):
                if v not in members:
                    continue
                back = _shortest_path(g, v, u, members)
                assert back is not None  # same SCC
                cyc = [u, *back]  # u -> v -> ... -> u
                ring = cyc[:-1]
                k = ring.index(min(ring))
                key = tuple(ring[k:] + ring[:k])
                if key not in cycles:
                    cycles[key] = [*key, key[0]]
        header = f"{len(comp)} modules import each other in a circle at runtime: {', '.join(comp)}"
        for n, cyc in enumerate(sorted(cycles.values(), key=lambda c: (len(c), c))):
            if n == max_per_group:
                out.append(f"{header}; ... and {len(cycles) - n} more cycles in this group")
                break
            steps = [f"{cyc[i]} -> {cyc[i + 1]} [{g[cyc[i]][cyc[i + 1]].describe()}]" for i in range(len(cyc) - 1)]
            out.append(f"import cycle: {' ; '.join(steps)}.  Break it: the lower module must not import the "
                       f"higher one, even lazily ({header})")
    return out


def _annotation_nodes(tree: ast.AST) -> Set[int]:
    """ids of every node inside an annotation (function args/returns, AnnAssign annotations)."""
    ids: Set[int] = set()
    for node in ast.walk(tree):
        anns: List[Optional[ast.expr]] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            anns.append(node.returns)
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    anns.append(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        for ann in anns:
            if ann is not None:
                ids.update(id(n) for n in ast.walk(ann))
    return ids


def _has_future_annotations(tree: ast.Module) -> bool:
    return any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
               and any(a.name == "annotations" for a in s.names) for s in tree.body)


def _type_only_statements(tree: ast.Module) -> List[ast.stmt]:
    """Statements that run only under a type checker (``if TYPE_CHECKING:`` / ``else`` of ``if not ...``)."""
    out: List[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            tc = is_type_checking(node.test)
            if tc is not None:
                out.extend(node.body if tc else node.orelse)
    return out


def _bindings(nodes: Iterable[ast.AST], skip: Set[int]) -> Set[str]:
    """Names bound at runtime by these nodes (imports, assignments, defs, parameters), outside ``skip``."""
    out: Set[str] = set()
    for top in nodes:
        for n in ast.walk(top):
            if id(n) in skip:
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.update(a.asname or a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
    return out


def _rebound_at_runtime(tree: ast.Module, names: Set[str], skip: Set[int]) -> Set[int]:
    """ids of Name nodes whose name a runtime binding shadows: ``from .x import T`` inside the
    function that uses ``T``, or a module-level runtime binding of the same name."""
    out: Set[int] = set()
    top = {n for n in _bindings([s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef))], skip) if n in names}
    for fn in ast.walk(tree):
        local = top
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local = top | (_bindings([fn.args, *(fn.body if isinstance(fn.body, list) else [fn.body])], skip) & names)
        elif fn is not tree:
            continue
        if local:
            out.update(id(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in local)
    return out


def check_type_only(package: Package, table: Table) -> List[str]:
    """Names imported under TYPE_CHECKING are used only in annotations.

    A runtime use raises NameError; when the import points up, across features or back into a
    runtime cycle, it is also the dependency the layer rule forbids, and the message says so.
    """
    out: List[str] = []
    g = runtime_graph(package)
    feats = next((set(layer.units) for layer in table.layers if layer.label == FEATURES), set())

    def reaches(a: str, b: str) -> bool:
        return a in g and b in g and _shortest_path(g, a, b, set(g)) is not None

    for m in package.modules.values():
        future = _has_future_annotations(m.tree)
        in_annotation = _annotation_nodes(m.tree) if future else set()
        # Names bound by type-only imports: name -> (imported module, line, why it must stay type-only,
        # or None when only the NameError is at stake).
        bound: Dict[str, Tuple[str, int, Optional[str]]] = {}
        for node in _type_only_statements(m.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for alias in node.names:
                if isinstance(node, ast.Import):
                    dst = alias.name
                else:
                    base = _resolve_base(m, node.level, node.module) or ""
                    sub = f"{base}.{alias.name}"
                    dst = sub if sub in package.modules else base
                why: Optional[str] = None
                if _in_pkg(dst, PKG):
                    src_unit, dst_unit = m.unit, unit_of(dst)
                    sl, dl = table.layer_of(src_unit), table.layer_of(dst_unit)
                    if sl and dl and dl.number > sl.number:
                        why = f"{dst} is in a higher layer ({dl.number} {dl.label} > {sl.number} {sl.label})"
                    elif src_unit in feats and dst_unit in feats and src_unit != dst_unit:
                        why = f"{dst} is another feature"
                    elif reaches(dst, m.name):
                        why = f"{dst} imports {m.name} at runtime (a cycle)"
                bound[alias.asname or alias.name.split(".")[0]] = (dst, node.lineno, why)
        if not bound:
            continue
        type_only_nodes = {id(n) for b in _type_only_statements(m.tree) for n in ast.walk(b)}
        rebound = _rebound_at_runtime(m.tree, set(bound), type_only_nodes)
        for use in ast.walk(m.tree):
            if isinstance(use, ast.Name) and use.id in bound and isinstance(use.ctx, ast.Load) \
                    and id(use) not in in_annotation and id(use) not in type_only_nodes \
                    and id(use) not in rebound:
                dst, line, why = bound[use.id]
                hint = "" if future else " (this module lacks `from __future__ import annotations`, so its " \
                                         "annotations run too)"
                head = (f"{m.path}:{use.lineno}: {use.id!r} is used at runtime{hint}, but it is imported only "
                        f"under TYPE_CHECKING ({m.path}:{line}), so that line raises NameError")
                if why is None:
                    out.append(f"{head}; nothing forbids a runtime import of {dst} here: move the import out of "
                               "the TYPE_CHECKING block (or import it in the function that uses it)")
                else:
                    out.append(f"{head}; the import must stay type-only because {why}: use the name in "
                               "annotations only, or depend on a lower-layer object instead")
    return out


def _defined_private_attrs(tree: ast.Module) -> Set[str]:
    """Private names this module defines as attributes: class-body names, __slots__, ``x._a = ...``."""
    names: Set[str] = set()

    def targets(t: ast.expr) -> Iterator[ast.expr]:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
                elif isinstance(stmt, ast.Assign):
                    for t in stmt.targets:
                        for e in targets(t):
                            if isinstance(e, ast.Name):
                                names.add(e.id)
                                if e.id == "__slots__":
                                    names.update(c.value for c in ast.walk(stmt.value)
                                                 if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            tlist = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in tlist:
                for e in targets(t):
                    if isinstance(e, ast.Attribute):
                        names.add(e.attr)
    return {n for n in names if is_private(n)}


def _is_self_like(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Name) and expr.id in ("self", "cls", "mcs"):
        return True
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        if expr.func.id == "super":
            return True
        if expr.func.id == "type" and len(expr.args) == 1 and _is_self_like(expr.args[0]):
            return True
    return isinstance(expr, ast.Attribute) and expr.attr == "__class__" and _is_self_like(expr.value)


def check_private(package: Package) -> List[str]:
    """Check 5: no private name imported from another module, no other module's private attribute touched."""
    out: List[str] = []
    for m in package.modules.values():
        out.extend(_private_in_module(m, package))
    return out


def _private_in_module(m: Module, package: Package) -> List[str]:
    out: List[str] = []
    defined = _defined_private_attrs(m.tree)
    # Names bound to modules (import x / import a.b as c / from . import errors), and names bound
    # to things imported from another casstore module (classes that annotate parameters).
    module_aliases: Dict[str, str] = {}
    casstore_imported: Dict[str, str] = {}
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                module_aliases[bound] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(m, node.level, node.module)
            if base is None:
                continue
            for alias in node.names:
                bound = alias.asname or alias.name
                if f"{base}.{alias.name}" in package.modules:
                    module_aliases[bound] = f"{base}.{alias.name}"
                elif _in_pkg(base, PKG):
                    casstore_imported[bound] = base
                if alias.name == "*" or not is_private(alias.name) or base == m.name:
                    continue
                if f"{base}.{alias.name}" in package.modules or (base, alias.name) in ALLOWED_PRIVATE_MODULE_ATTRS:
                    continue  # a private *module* of the package (_fs, _lock) is meant to be imported
                out.append(f"{m.path}:{node.lineno}: `from {'.' * node.level}{node.module or ''} import "
                           f"{alias.name}` imports the private name {alias.name} of {base}; make it public "
                           f"there (no underscore, a docstring) or move the code that needs it into {base}")
    foreign_params = _foreign_params(m.tree, casstore_imported)

    def report(node: ast.AST, expr: ast.expr, attr: str) -> None:
        if attr in ALLOWED_PRIVATE_ATTRS or _is_self_like(expr):
            return
        where = f"{m.path}:{getattr(node, 'lineno', 0)}: `{_short(node)}`"
        chain = _dotted(expr)
        root = chain[0] if chain else None
        if chain and root in module_aliases:  # mod._x, mod.sub._x, mod.Class._x
            owner = ".".join([module_aliases[chain[0]], *chain[1:]])
            if (owner, attr) not in ALLOWED_PRIVATE_MODULE_ATTRS:
                out.append(f"{where} reads the private {attr} of {owner}; make it public there (for the standard "
                           "library: justify an entry in ALLOWED_PRIVATE_MODULE_ATTRS in tests/test_layers.py, "
                           "or avoid it)")
            return
        owner_desc: Optional[str] = None
        if root is not None and root in casstore_imported:  # Store._x, Store.attr._x
            owner_desc = f"{root} (imported from {casstore_imported[root]})"
        elif isinstance(expr, ast.Name) and (id(node), expr.id) in foreign_params:  # store._x with store: Store
            owner_desc = foreign_params[(id(node), expr.id)]
        if owner_desc is None and attr in defined:
            return  # an attribute of this module's own objects
        whose = f" of {owner_desc}" if owner_desc else ""
        out.append(f"{where} touches the private attribute {attr}{whose}, which {m.path} does not own; use "
                   "(or add) a public method or property on the owner instead")

    for node in ast.walk(m.tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            report(node, node.value, node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            a = node.args[1]
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and is_private(a.value):
                report(node, node.args[0], a.value)
    return out


def _dotted(expr: ast.expr) -> Optional[List[str]]:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything that is not a plain name chain."""
    parts: List[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return [expr.id, *parts[::-1]]


def _short(node: ast.AST) -> str:
    s = ast.unparse(node)
    return s if len(s) <= 60 else s[:57] + "..."


def _foreign_params(tree: ast.Module, casstore_imported: Mapping[str, str]) -> Dict[Tuple[int, str], str]:
    """``{(id(attribute node), param): owner}`` for private accesses on a parameter annotated with a
    class imported from another casstore module (``store: Store``): those objects are not ours,
    even when this module happens to define an attribute of the same name."""
    out: Dict[Tuple[int, str], str] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        owners: Dict[str, str] = {}
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
            if arg.annotation is None or arg.arg in ("self", "cls"):
                continue
            ann: ast.AST = arg.annotation
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                try:
                    ann = ast.parse(ann.value, mode="eval")
                except SyntaxError:
                    continue
            for n in ast.walk(ann):
                if isinstance(n, ast.Name) and n.id in casstore_imported:
                    owners[arg.arg] = f"a {n.id} (from {casstore_imported[n.id]})"
        if not owners:
            continue
        for node in ast.walk(fn):
            expr: Optional[ast.expr] = None
            if isinstance(node, ast.Attribute):
                expr = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                expr = node.args[0]
            if isinstance(expr, ast.Name) and expr.id in owners:
                out[(id(node), expr.id)] = owners[expr.id]
    return out


# -- running on the real tree ---------------------------------------------------------------------


def real() -> Tuple[Package, Table]:
    return scan(read_sources()), parse_table(DESIGN.read_text(encoding="utf-8"))


def _fail(what: str, msgs: Sequence[str]) -> None:
    if msgs:
        pytest.fail(f"{what} ({len(msgs)}):\n  " + "\n  ".join(msgs), pytrace=False)


def test_every_module_has_a_layer() -> None:
    package, table = real()
    _fail("modules without a layer in docs/design.md (## Layers)", check_placed(package, table))


def test_no_upward_imports() -> None:
    package, table = real()
    _fail("imports that go up a layer (lazy ones included)", check_upward(package, table))


def test_features_do_not_import_each_other() -> None:
    package, table = real()
    _fail("feature units importing each other", check_features_independent(package, table))


def test_no_import_cycles() -> None:
    package, _ = real()
    _fail("runtime import cycles (lazy imports included, TYPE_CHECKING excluded)", find_cycles(package))


def test_type_only_imports_stay_type_only() -> None:
    package, table = real()
    _fail("names imported under TYPE_CHECKING but used at runtime", check_type_only(package, table))


def test_no_private_access_across_modules() -> None:
    package, _ = real()
    _fail("private names or attributes used outside their module", check_private(package))


def test_layer_table_matches_modules() -> None:
    package, table = real()
    _fail("stale or malformed entries in the docs/design.md layer table", check_table_current(package, table))


# -- self-tests: every checker reports what it must, on synthetic packages --------------------------

SYN_TABLE = """
Some prose.

```layers
0 core: errors _fs low
1 mid: mid
4 features: f1 f2
5 facade: store __init__
```
"""


def syn(files: Mapping[str, str], table: str = SYN_TABLE) -> Tuple[Package, Table]:
    base = {"casstore/__init__.py": "", "casstore/errors.py": "", "casstore/_fs.py": "def copy(): pass\n",
            "casstore/low.py": "", "casstore/mid.py": "", "casstore/f1/__init__.py": "",
            "casstore/f2/__init__.py": "", "casstore/store.py": ""}
    base.update(files)
    return scan(base), parse_table(table)


def test_selftest_clean_package_passes() -> None:
    package, table = syn({
        "casstore/__init__.py": "from .store import Store\nfrom . import errors\n",
        "casstore/store.py": "from .f1 import run\nfrom .mid import M\nclass Store:\n    pass\n",
        "casstore/f1/__init__.py": "from .impl import run\n",
        "casstore/f1/impl.py": ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                                "from .. import _fs\nimport os\nimport collections\n"
                                "if TYPE_CHECKING:\n    from ..store import Store\n"
                                "def run(store: Store) -> None:\n    _fs.copy()\n    os._exit(0)\n"
                                "    p = collections.namedtuple('P', 'a')(1)\n    p._replace(a=2)\n"),
        "casstore/mid.py": ("from .low import thing\nclass M:\n    __slots__ = ('_x',)\n"
                            "    def eq(self, other: M) -> bool:\n        return self._x == other._x\n"),
        "casstore/low.py": "from .errors import E\nthing = 1\n",
        "casstore/errors.py": "class E(Exception):\n    pass\n",
    })
    for check in (check_placed(package, table), check_upward(package, table),
                  check_features_independent(package, table), find_cycles(package),
                  check_type_only(package, table), check_private(package), check_table_current(package, table)):
        assert check == []


def test_selftest_cycle_reported_with_path() -> None:
    package, _ = syn({
        "casstore/low.py": "from .mid import x\n",
        "casstore/mid.py": "x = 1\ndef f():\n    from .low import y\n",
    })
    msgs = find_cycles(package)
    assert len(msgs) == 1, msgs
    assert "casstore.low -> casstore.mid [casstore/low.py:1 (top-level import)]" in msgs[0]
    assert "casstore.mid -> casstore.low [casstore/mid.py:3 (lazy import in f())]" in msgs[0]
    # The same back edge under TYPE_CHECKING is no cycle.
    package, _ = syn({
        "casstore/low.py": "from .mid import x\n",
        "casstore/mid.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .low import y\n",
    })
    assert find_cycles(package) == []


def test_selftest_cycle_through_subpackage_init_and_longer_ring() -> None:
    package, _ = syn({
        "casstore/f1/__init__.py": "from .a import A\n",
        "casstore/f1/a.py": "from ..store import S\n",
        "casstore/store.py": "def g():\n    from .f1.a import A\n",  # runs f1/__init__ too
        "casstore/low.py": "import casstore.mid\n",
        "casstore/mid.py": "from . import errors\nfrom .f2 import z\n",
        "casstore/f2/__init__.py": "def h():\n    import importlib\n    importlib.import_module('casstore.low')\n",
    })
    msgs = find_cycles(package)
    text = "\n".join(msgs)
    assert "casstore.f1.a -> casstore.store" in text and "casstore.store -> casstore.f1.a" in text
    assert "casstore.low -> casstore.mid" in text and "casstore.f2 -> casstore.low" in text
    assert "importlib.import_module call" not in text and "importlib.import_module in h()" in text


def test_selftest_upward_import_reported() -> None:
    package, table = syn({
        "casstore/low.py": "def f():\n    from .store import Store\n",
        "casstore/mid.py": "import casstore\n",
        "casstore/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .store import S\n",
    })
    msgs = check_upward(package, table)
    assert len(msgs) == 2, msgs
    assert msgs[0].startswith("casstore/low.py:2 (lazy import in f())") and "layer 5 facade" in msgs[0]
    assert msgs[1].startswith("casstore/mid.py:1 (top-level import)") and "imports casstore (layer 5" in msgs[1]


def test_selftest_missing_and_dynamic_imports_reported() -> None:
    package, table = syn({
        "casstore/store.py": ("from .gone import x\nimport importlib\nm = 'x'\n"
                              "importlib.import_module(f'casstore.{m}')\n"),
    })
    msgs = check_upward(package, table)
    assert any("imports casstore.gone, which does not exist" in s for s in msgs), msgs
    assert any("whose name is computed" in s for s in msgs), msgs


def test_selftest_feature_cross_import_reported() -> None:
    package, table = syn({
        "casstore/f1/x.py": "from ..f2 import y\n",
        "casstore/f2/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..f1 import x\n",
    })
    msgs = check_features_independent(package, table)
    assert len(msgs) == 1 and "feature 'f1' imports feature 'f2'" in msgs[0], msgs


def test_selftest_private_import_reported() -> None:
    package, _ = syn({
        "casstore/mid.py": "from .low import _helper, public\nfrom . import _fs\nfrom ._fs import copy\n",
        "casstore/low.py": "def _helper(): pass\npublic = 1\n",
    })
    msgs = check_private(package)
    assert len(msgs) == 1 and msgs[0].startswith("casstore/mid.py:1:") and "_helper" in msgs[0], msgs


def test_selftest_private_attribute_reported() -> None:
    package, _ = syn({
        "casstore/low.py": "class Obj:\n    def __init__(self):\n        self._secret = 1\n        self._tmp = 2\n",
        "casstore/mid.py": (
            "import os\nimport sys\nfrom . import _fs\nfrom .low import Obj\n"
            "class Mine:\n    def __init__(self):\n        self._tmp = 0\n"
            "    def ok(self, other: 'Mine'):\n        return self._tmp, other._tmp, super()._tmp, type(self)._tmp\n"
            "def bad(o, store: Obj):\n"
            "    a = o._secret\n"                     # 11: not defined here
            "    b = _fs._private\n"                  # 12: a module's private
            "    c = getattr(o, '_secret')\n"         # 13: string access
            "    d = store._tmp\n"                    # 14: same name defined here, but store is an Obj
            "    os._exit(0); sys._getframe()\n"      # 15: allowlisted
            "    os._wrap_close\n"                    # 16: not allowlisted
            "    return o.__class__, o.__dict__\n"    # dunders are not private
        ),
    })
    msgs = check_private(package)
    lines = sorted(int(s.split(":")[1]) for s in msgs)
    assert lines == [11, 12, 13, 14, 16], msgs
    assert any("`store._tmp` touches the private attribute _tmp of a Obj (from casstore.low)" in s for s in msgs), msgs


def test_selftest_type_only_used_at_runtime_reported() -> None:
    package, table = syn({
        "casstore/f1/__init__.py": (
            "from __future__ import annotations\nfrom typing import TYPE_CHECKING, cast\n"
            "if TYPE_CHECKING:\n    from ..store import Store\n"
            "def f(s: Store) -> Store:\n    x: Store = s\n    return cast('Store', x)\n"   # fine
            "def g(s):\n    return isinstance(s, Store)\n"                                # 9: runtime
        ),
        "casstore/mid.py": ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                            "if TYPE_CHECKING:\n    from .low import L\nx = L\n"),  # 5: NameError
        "casstore/store.py": (  # store type-imports a feature that imports it: fine while type-only
            "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .f1 import T\n"
            "def f() -> T:\n    from .f1 import T\n    return T()\n"  # rebound by a runtime import: not reported
        ),
        "casstore/f2/__init__.py": (  # no future import: annotations are evaluated
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..store import Store\n"
            "def f(s: Store) -> None:\n    pass\ndef ok(s: 'Store') -> None:\n    pass\n"
        ),
    })
    msgs = check_type_only(package, table)
    where = [s.split(":")[0:2] for s in msgs]
    assert where == [["casstore/f1/__init__.py", "9"], ["casstore/f2/__init__.py", "4"], ["casstore/mid.py", "5"]], msgs
    assert "lacks `from __future__ import annotations`" in msgs[1] and "must stay type-only" in msgs[1]
    assert "move the import out of the TYPE_CHECKING block" in msgs[2]


def test_selftest_table_unplaced_stale_and_malformed() -> None:
    table = SYN_TABLE.replace("5 facade", "3 old: gone\n5 facade").replace("0 core", "zero core")
    package, parsed = syn({"casstore/newthing.py": "", "casstore/refs.py": "", "casstore/refs/__init__.py": "",
                           "casstore/cli/app.py": ""}, table)
    placed = check_placed(package, parsed)
    assert any("unit 'newthing'" in s for s in placed) and any("unit 'low'" in s for s in placed), placed
    assert any("casstore/refs.py and casstore/refs/__init__.py both define" in s for s in placed), placed
    assert any("casstore/cli/ holds modules but no __init__.py" in s for s in placed), placed
    stale = check_table_current(package, parsed)
    assert any("names 'gone'" in s for s in stale), stale
    assert any("'zero core" in s and "is not '<number>" in s for s in stale), stale
    assert parse_table("no block").errors and parse_table(SYN_TABLE + SYN_TABLE).errors
    dup = parse_table("```layers\n0 a: x\n1 b: x\n```\n")
    assert any("listed in layer 0 and again in layer 1" in s for s in dup.errors)


def test_selftest_real_table_parses() -> None:
    table = parse_table(DESIGN.read_text(encoding="utf-8"))
    assert table.errors == [] and [layer.label for layer in table.layers][:1] == ["core"]
    assert any(layer.label == FEATURES for layer in table.layers)



def test_lazy_package_names_are_never_shadowed_by_submodules() -> None:
    # casstore's names are imported on first use (casstore/_lazy.py).  Importing a submodule binds
    # it on its package, which would hide a lazy name of the same spelling (``maintenance.verify``
    # was the module, not the function, once ``casstore.maintenance.verify`` had been imported).
    import subprocess
    import sys

    code = """
import importlib, pkgutil, types, casstore
for m in pkgutil.walk_packages(casstore.__path__, "casstore."):
    if not m.name.startswith(("casstore.cli", "casstore.compat", "casstore.fsspec", "casstore.adapters")):
        importlib.import_module(m.name)
bad = [n for n in casstore.__all__ if n != "errors" and isinstance(getattr(casstore, n), types.ModuleType)]
print(bad)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

if __name__ == "__main__":
    pkg, tbl = real()
    for title, msgs in [("1 unplaced", check_placed(pkg, tbl)), ("2 upward", check_upward(pkg, tbl)),
                        ("3 features", check_features_independent(pkg, tbl)), ("4 cycles", find_cycles(pkg)),
                        ("type-only used at runtime", check_type_only(pkg, tbl)),
                        ("5 private", check_private(pkg)), ("6 stale table", check_table_current(pkg, tbl))]:
        print(f"== {title}: {len(msgs)}")
        for s in msgs:
            print("  " + s)
