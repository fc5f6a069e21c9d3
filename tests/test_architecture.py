"""The house's three layers, checked on every import statement of the code (those inside functions too).

- core ``prorag``: formats, data, metrics, algorithms, model building, registry, rollout loop, engine
  interface, training loop, and its wire plumbing in ``prorag.rpc`` (servers, security, batching, protobuf
  conversion, metrics, typed clients; with ``prorag.pb`` and the generated ``prorag.v1``). Imports neither
  ``services`` nor ``prorag_app``; its domain modules (every one outside the wire packages) never import the wire
  packages: what they compute is the same whether it came over the network or not.
- services ``services/<name>``: each imports the core and itself, never a sibling service nor the app.
- app ``prorag_app``: CLI, pipeline, bench, process stack, embedded builder, evaluation runners. The only
  layer that may import services.

And no circles: no module imports itself through others, whether the imports sit at the top or inside functions
(an import inside a function only hides a circle, it still ties the two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("prorag", "services", "prorag_app")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``; relative imports resolved against ``module``."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from services import retriever` imports the submodule
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


#: the core's wire packages: the RPC plumbing, the stubs' import point and the generated stubs
WIRE = ("prorag.rpc", "prorag.pb", "prorag.v1")


def is_wire(module: str) -> bool:
    return any(module == w or module.startswith(w + ".") for w in WIRE)


def violation(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (None when it may)."""
    top = imported.split(".")[0]
    layer = importer.split(".")[0]
    if layer == "prorag" and top in ("services", "prorag_app"):
        return f"the core ({importer}) imports {imported}"
    if layer == "prorag" and is_wire(imported) and not is_wire(importer):
        return f"domain module {importer} imports the wire plumbing ({imported})"
    if layer == "services":
        if top == "prorag_app":
            return f"a service ({importer}) imports the app ({imported})"
        mine = importer.split(".")[1] if importer.count(".") else ""
        theirs = imported.split(".")[1] if top == "services" and imported.count(".") else ""
        if top == "services" and theirs and mine and theirs != mine:
            return f"service {mine} ({importer}) imports sibling service {theirs} ({imported})"
    return None


def layer_violations(root: Path) -> list[str]:
    found = []
    for layer in LAYERS:
        base = root / layer
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("prorag", "v1"):  # generated protobuf stubs
                continue
            module = module_name(root, path)
            tree = ast.parse(path.read_text(), filename=str(path))
            lines_seen = set()  # one report per import statement
            for line, imported in imported_modules(tree, module, path.name == "__init__.py"):
                why = violation(module, imported)
                if why and line not in lines_seen:
                    lines_seen.add(line)
                    found.append(f"{rel}:{line}: {why}")
    return found


def test_the_code_keeps_its_layers():
    assert layer_violations(REPO) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_wrong_import_is_caught_wherever_it_hides(tmp_path):
    root = _tree(tmp_path, {
        "prorag/__init__.py": "",
        "prorag/ok.py": "from prorag.metrics import f1_score\n",
        "prorag/bad.py": "def f():\n    from services.policy.engine import TransformersEngine\n",
        "prorag/sub/__init__.py": "",
        "prorag/sub/worse.py": "import importlib\nimportlib.import_module('prorag_app.cli')\n",
        "prorag/rpc/__init__.py": "",
        "prorag/rpc/clients.py": "from prorag.pb import common_pb2\nfrom prorag.metrics import f1_score\n",
        "prorag/search/__init__.py": "",
        "prorag/search/env.py": "def f():\n    from prorag.rpc.clients import call_with_service_wait\n",
        "prorag/wired.py": "from prorag import pb\nfrom prorag.v1 import prm_pb2\n",
        "services/__init__.py": "",
        "services/policy/__init__.py": "",
        "services/policy/server.py": "from . import engine\nfrom services.policy import manager\n",
        "services/trainer/__init__.py": "",
        "services/trainer/stage.py": "from services.retriever import http\n",
        "services/judge/server.py": "from ..prm import server\n",
        "prorag_app/__init__.py": "",
        "prorag_app/cli.py": "from services.retriever.server import start\n",
    })
    found = layer_violations(root)
    assert any(f.startswith("prorag/bad.py:2: the core") for f in found)
    assert any(f.startswith("prorag/sub/worse.py:2: the core") for f in found)
    assert any(f.startswith("services/trainer/stage.py:1: service trainer") and "sibling service retriever" in f
               for f in found)
    assert any(f.startswith("services/judge/server.py:1: service judge") and "sibling service prm" in f for f in found)
    # a domain module reaching for the wire, however it spells it
    assert any(f.startswith("prorag/search/env.py:2: domain module prorag.search.env imports the wire") for f in found)
    assert any(f.startswith("prorag/wired.py:1: domain module") for f in found)
    assert any(f.startswith("prorag/wired.py:2: domain module") for f in found)
    # the app, a service importing itself, core-to-core imports and the wire importing the domain are allowed
    assert len(found) == 7, found


# ---------------------------------------------------------------- no circles
def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _without_type_checking(tree: ast.AST) -> ast.AST:
    """``tree`` without its ``if TYPE_CHECKING:`` blocks: those run under a type checker only, never at import, so
    they tie no modules together at run time (annotations may name a module that imports this one)."""
    class Strip(ast.NodeTransformer):
        def visit_If(self, node):
            return None if _is_type_checking(node) else self.generic_visit(node)

    return Strip().visit(tree)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the line of the first such import}, over every import statement at
    any depth (inside functions too) and importlib calls; a name is resolved to the longest project module it
    starts with (``from prorag_app.eval import evaluate`` -> prorag_app.eval)."""
    paths = {}
    for layer in LAYERS:
        if (root / layer).is_dir():
            paths.update({module_name(root, p): p for p in sorted((root / layer).rglob("*.py"))
                          if p.relative_to(root).parts[:2] != ("prorag", "v1")})

    def resolve(name: str) -> str:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        tree = _without_type_checking(ast.parse(path.read_text(), filename=str(path)))
        edges = graph.setdefault(module, {})
        for line, imported in imported_modules(tree, module, path.name == "__init__.py"):
            target = resolve(imported)
            if target and target != module:
                edges.setdefault(target, line)
    return graph


def import_cycles(root: Path) -> list[str]:
    """One line per circle (strongly connected set of modules): a path through it with the line of each import."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:  # Tarjan's algorithm, iterative: the graph is deeper than Python's recursion limit allows
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    found = []
    for component in components:
        # the shortest way from the first module back to itself inside the component
        first = min(component)
        came_from = {first: None}
        queue = [first]
        while queue:
            node = queue.pop(0)
            if first in graph[node]:
                break
            for child in sorted(graph[node]):
                if child in component and child not in came_from:
                    came_from[child] = node
                    queue.append(child)
        path = [node]
        while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
        path.reverse()
        path.append(first)
        steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:]))
        found.append(f"{steps} -> {first}; the circle: {', '.join(sorted(component))}")
    return sorted(found)


def test_no_module_imports_itself_through_others():
    """Break a circle by moving what the modules share into a third one both import; an import moved into a function
    does not break it."""
    assert import_cycles(REPO) == []


def test_a_circle_is_caught_wherever_its_imports_hide(tmp_path):
    root = _tree(tmp_path, {
        "prorag_app/__init__.py": "",
        # a circle of three through a function-level import and an importlib call
        "prorag_app/profiles.py": "from prorag_app.stage2 import Settings\n",
        "prorag_app/stage2.py": "def run():\n    from prorag_app import eval\n",
        "prorag_app/eval.py": "import importlib\n\ndef f():\n    importlib.import_module('prorag_app.profiles')\n",
        # two modules through relative imports, one nested in a class and a branch
        "services/__init__.py": "",
        "services/policy/__init__.py": "",
        "services/policy/server.py": "from .servicer import Servicer\n",
        "services/policy/servicer.py": "class S:\n    def f(self):\n        if 1:\n            from . import server\n",
        # not circles: a one-way chain, a module importing itself, and imports a type checker alone reads
        "prorag/__init__.py": "",
        "prorag/a.py": "import prorag.b\nfrom prorag import a\n",
        "prorag/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prorag.a import X\n",
        "prorag/c.py": "import typing\nif typing.TYPE_CHECKING:\n    import prorag.d\n",
        "prorag/d.py": "import prorag.c\n",
    })
    found = import_cycles(root)
    assert len(found) == 2, found
    app = next(f for f in found if "prorag_app" in f)
    assert app.startswith("prorag_app.eval (line 4) -> prorag_app.profiles (line 1) -> prorag_app.stage2 (line 2) "
                          "-> prorag_app.eval"), app
    assert any("the circle: services.policy.server, services.policy.servicer" in f for f in found), found
