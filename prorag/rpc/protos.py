"""Build and import the gRPC stubs generated from protos/.

The stubs are build outputs (``make proto`` or the first import): they land in
``prorag/v1/`` so protoc's own ``from prorag.v1 import ...`` imports resolve, and
are never edited or committed. Regeneration happens when any .proto is newer
than its stub, so a changed contract cannot run against stale stubs.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # prorag/: the stubs go to prorag/v1
PROTO_ROOT = PACKAGE_DIR.parent / "protos"
OUT_DIR = PACKAGE_DIR / "v1"
PROTO_NAMES = ("common", "retriever", "policy", "prm", "judge", "trainer")

#: fully-qualified gRPC service names, as health checks and reflection see them
SERVICE_NAMES = {
    "retriever": "prorag.v1.Retriever",
    "policy": "prorag.v1.Policy",
    "prm": "prorag.v1.ProcessRewardModel",
    "judge": "prorag.v1.Judge",
    "trainer": "prorag.v1.Trainer",
}


def _stale() -> bool:
    for name in PROTO_NAMES:
        src = PROTO_ROOT / "prorag" / "v1" / f"{name}.proto"
        out = OUT_DIR / f"{name}_pb2.py"
        if not out.exists():
            return True
        if src.exists() and src.stat().st_mtime > out.stat().st_mtime:
            return True
    return not (OUT_DIR / "__init__.py").exists()


def build(force: bool = False) -> Path:
    """Generate ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` into prorag/v1 atomically."""
    if not force and not _stale():
        return OUT_DIR
    if not PROTO_ROOT.exists():
        raise RuntimeError(f"protos/ not found at {PROTO_ROOT}; stubs cannot be generated")
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(PROTO_ROOT / "prorag" / "v1" / f"{n}.proto") for n in PROTO_NAMES]
    with tempfile.TemporaryDirectory(dir=PACKAGE_DIR) as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on protos/; see the messages above")
        gen = Path(tmp) / "prorag" / "v1"
        (gen / "__init__.py").write_text('"""Generated from protos/prorag/v1 by prorag.rpc.protos; do not edit."""\n')
        OUT_DIR.mkdir(exist_ok=True)
        # Several processes may import at once (prorag up); os.replace per file keeps each one whole.
        for f in sorted(gen.iterdir()):
            os.replace(f, OUT_DIR / f.name)
    importlib.invalidate_caches()
    return OUT_DIR


def ensure() -> None:
    if _stale():
        build()


if __name__ == "__main__":
    out = build(force="--force" in sys.argv)
    print(f"stubs in {out}")
