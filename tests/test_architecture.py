"""The house's three layers, checked on every import statement of the code (those inside functions too).

- core ``prorag``: formats, data, metrics, algorithms, model building, registry, rollout loop, engine
  interface, training loop, and its wire plumbing in ``prorag.rpc`` (servers, security, batching, protobuf
  conversion, metrics, typed clients; with ``prorag.pb`` and the generated ``prorag.v1``). Imports neither
  ``services`` nor ``prorag_app``; its domain modules (every one outside the wire packages) never import the wire
  packages: what they compute is the same whether it came over the network or not.
- services ``services/<name>``: each imports the core and itself, never a sibling service nor the app.
- app ``prorag_app``: CLI, pipeline, bench, process stack, embedded builder, evaluation runners. The only
  layer that may import services.
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
