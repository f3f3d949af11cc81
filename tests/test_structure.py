"""The package's shape, enforced (issue 40, docs/design.md "Layers"): no import circle; the plan
layer and the runtime model import no torch; the runtime imports nothing from the lab; no
module over 600 lines; no function on the call path or in the plan builders over 8
parameters. Read from the source with ``ast`` (nothing imported), so a violation is named by
file and line, and each rule is checked to catch a planted violation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "charm_megatron"
PACKAGE = "charm_megatron"
MAX_LINES = 600
MAX_PARAMS = 8
# The call path and the plan builders, where arguments must travel as objects.
PARAM_LAYERS = ("ops", "plan", "algorithms")
# Allowed over the bound: the public entry itself (its keywords are its API) and an options
# object's constructor (its keyword fields).
PARAM_EXEMPT = {("ops/attention.py", "cp_attention"), ("ops/options.py", "__init__")}
# Packages no runtime module may import from, and the runtime's own layers.
LAB = ("lab",)
# Front ends allowed to use the lab: the command dispatcher (it lists the lab's commands and
# imports one only when run) and the two demo jobs, whose emulated clusters are the lab's.
TOOLS = ("cli", "__main__", "demo", "train_demo")
NO_TORCH = ("plan", "algorithms", "model", "devices")


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(root.rglob("*.py"))}


def _imports(path: Path, module: str, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    """The package modules ``path`` imports, with line numbers. ``top_level_only``: only
    imports run when the module is imported (not those inside functions, which are the
    package's way of deferring a heavy or circular import to its use)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # also imports under a top-level if / try (TYPE_CHECKING excluded)
        extra = []
        for node in tree.body:
            if isinstance(node, (ast.If, ast.Try)):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                extra.extend(n for n in ast.walk(node))
        nodes = [*nodes, *extra]
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            found.extend((f"{target}.{a.name}", node.lineno) for a in node.names)
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> package modules it imports when imported (function-level imports excluded)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for target, _ in _imports(path, name, top_level_only=True):
            # A module's own packages are imported before it: not an edge of a circle.
            if target in modules and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` imports ``a`` and ``a.b`` first: add those edges, so a circle
    through a package's ``__init__`` is seen."""
    out = {k: set(v) for k, v in graph.items()}
    for name, deps in graph.items():
        for dep in deps:
            parts = dep.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in graph and parent != name and not name.startswith(parent + "."):
                    out[name].add(parent)
    return out


def test_no_import_circle():
    cycles = _cycles(_package_parents(_graph(_modules())))
    assert not cycles, "import circles (module-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_lab(module: str) -> bool:
    return _layer(module) in LAB


def test_runtime_imports_nothing_from_the_lab():
    bad = []
    for name, path in _modules().items():
        if _is_lab(name) or _layer(name) in TOOLS:
            continue
        for target, line in _imports(path, name):
            if target.startswith(PACKAGE + ".") and _is_lab(target):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "runtime modules import the lab:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", NO_TORCH)
def test_plan_algorithms_and_runtime_model_import_no_torch(layer):
    bad = []
    for name, path in _modules().items():
        if _layer(name) != layer:
            continue
        for target, line in _imports(path, name):
            if target == "torch" or target.startswith("torch."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, f"{layer}/ must not import torch:\n" + "\n".join(bad)


def test_no_module_over_the_line_bound():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters, ``self`` / ``cls`` excluded (``*args`` / ``**kw`` count one each)."""
    a = fn.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def _wide_functions(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    wide = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (rel, node.name) in PARAM_EXEMPT:
                continue
            if (n := _params(node)) > MAX_PARAMS:
                wide.append(f"{rel}:{node.lineno} {node.name}: {n} parameters")
    return wide


def test_no_function_on_the_call_path_takes_more_than_eight_parameters():
    wide = []
    for layer in PARAM_LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            wide += _wide_functions(path, str(path.relative_to(ROOT)))
    assert not wide, (f"functions over {MAX_PARAMS} parameters (pass an object):\n"
                      + "\n".join(wide))


def test_the_checks_catch_planted_violations(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "plan").mkdir(parents=True)
    (pkg / "lab").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "lab" / "__init__.py").write_text("")
    wide = pkg / "plan" / "wide.py"
    wide.write_text("import torch\nfrom charm_megatron.lab import tool\n"
                    "def f(a, b, c, d, e, f, g, h, i):\n    return a\n")
    assert _wide_functions(wide, "plan/wide.py") == ["plan/wide.py:3 f: 9 parameters"]
    imports = [t for t, _ in _imports(wide, "charm_megatron.plan.wide")]
    assert "torch" in imports and "charm_megatron.lab" in imports
    assert _module_name(wide, pkg) == "charm_megatron.plan.wide"
