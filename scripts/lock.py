#!/usr/bin/env python3
"""Regenerate requirements/*.lock, the hashed lockfiles the Dockerfile installs from (`pip install --require-hashes
--no-deps -r requirements/<lock>`), from pyproject.toml's dependencies and the pins of each image's base.

    python scripts/lock.py            all locks (needs uv==UV_VERSION on PATH or in this Python, and PyPI)
    python scripts/lock.py --check    exit 1 when a lock's recorded inputs differ from the current ones (no network)

One lock per kind of image (docs/DEPLOY.md, "Images"):

  cpu.lock             the five CPU images (python:3.11-slim, linux/amd64): everything, torch's CPU build included
                       (its wheel from build/wheels/ or /opt/wheels/ when present, else the PyTorch CPU index)
  cuda.lock            prorag-prm, prorag-trainer (pytorch/pytorch:2.14.0-cuda12.8-cudnn9-runtime)
  cuda-faiss-gpu.lock  prorag-retriever-gpu (the same base, faiss-gpu-cu12 in faiss-cpu's place)
  vllm.lock            prorag-policy (vllm/vllm-openai:v0.33.0)

The GPU locks are resolved together with what the base image pins (torch==2.14.0; vllm==0.33.0), so every locked
version is one the base's packages accept, and hold what prorag needs and the base does not provide: torch, vllm,
the CUDA wheels (nvidia-*, cuda-*, triton) and every package only the base's own pins need are left to the base image
(pinned by digest), never re-installed. They are universal (any Python >= 3.11, any platform): the Python of the GPU
bases was not checked. Each lock starts with the sha256 of its inputs (pyproject.toml's dependencies and this
target's pins), which `--check` and tests/deploy/test_locks.py compare with the current ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "requirements"
UV_VERSION = "0.13.9"
INDEX = "https://pypi.org/simple"
PYTHON = "3.11"
#: where the CPU build of torch may lie (the PyTorch CPU index was not reachable where the lock was first written)
TORCH_CPU_WHEELS = ("build/wheels", "/opt/wheels")

#: the targets: what replaces pyproject.toml's torch and faiss-cpu, what else is pinned, and what the base provides
TARGETS = {
    "cpu": {"torch": "torch==2.13.0+cpu", "faiss": None, "pins": ["transformers==5.24.0"], "base": [],
            "universal": False},
    # liger-kernel: the trainer's fused LM-head loss (fused_linear_ce); pure Triton, so it adds no CUDA wheel
    "cuda": {"torch": None, "faiss": None, "pins": ["transformers==5.20.2", "liger-kernel==0.8.5"],
             "base": ["torch==2.14.0"],
             "universal": True},
    "cuda-faiss-gpu": {"torch": None, "faiss": "faiss-gpu-cu12==1.14.1.post1", "pins": ["transformers==5.20.2"],
                       "base": ["torch==2.14.0"], "universal": True},
    "vllm": {"torch": None, "faiss": None, "pins": ["transformers==5.20.2"],
             "base": ["torch==2.14.0", "vllm==0.33.0"], "universal": True},
}
#: never in a GPU lock, whatever needs them: the base image's CUDA stack
BASE_ONLY = re.compile(r"^(torch|torchvision|torchaudio|vllm|triton(-.*)?|nvidia-.*|cuda-.*)$")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return canon(re.split(r"[<>=!~ \[;@]", req.strip(), maxsplit=1)[0])


def project_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def inputs(target: str) -> list[str]:
    """The requirement lines a target is resolved from."""
    t = TARGETS[target]
    out = []
    for dep in project_dependencies():
        name = req_name(dep)
        if name == "torch":
            if t["torch"]:
                out.append(t["torch"])
            continue
        if name == "faiss-cpu" and t["faiss"]:
            out.append(t["faiss"])
            continue
        out.append(dep)
    return out + t["pins"]


def inputs_sha256(target: str) -> str:
    t = TARGETS[target]
    blob = json.dumps({"inputs": inputs(target), "base": t["base"], "universal": t["universal"], "python": PYTHON},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def uv() -> list[str]:
    exe = shutil.which("uv")
    cmd = [exe] if exe else [sys.executable, "-m", "uv"]
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"lock.py needs uv=={UV_VERSION} (pip install uv=={UV_VERSION})")
    if UV_VERSION not in r.stdout:
        print(f"lock.py: {r.stdout.strip()} is not uv {UV_VERSION}; the locks may differ in form", file=sys.stderr)
    return cmd


def compile_(reqs: list[str], target: str, *, hashes: bool, find_links: str | None) -> str:
    t = TARGETS[target]
    with tempfile.TemporaryDirectory() as tmp:
        infile = Path(tmp) / f"{target}.in"
        infile.write_text("\n".join(reqs) + "\n")
        cmd = [*uv(), "pip", "compile", str(infile), "--python-version", PYTHON, "--index-url", INDEX,
               "--no-header", "--quiet", "--annotation-style", "line"]
        cmd += ["--universal"] if t["universal"] else ["--python-platform", "x86_64-manylinux_2_28"]
        if hashes:
            cmd.append("--generate-hashes")
        if find_links:
            cmd += ["--find-links", find_links]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "UV_NO_CONFIG": "1"})
        if r.returncode != 0:
            raise SystemExit(f"uv pip compile ({target}) failed:\n{r.stderr}")
        return r.stdout.replace(str(infile), f"{target}.in")


def blocks(text: str) -> dict[str, list[str]]:
    """A compiled requirements file split per package (a package may have several lines, one per marker)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if not line.startswith((" ", "\t")):
            current = out.setdefault(req_name(line), [])
            current.append(line)
        elif current is not None:
            current[-1] += "\n" + line
    return out


def lock(target: str) -> Path:
    t = TARGETS[target]
    find_links = next((str(ROOT / d) if not d.startswith("/") else d for d in TORCH_CPU_WHEELS
                       if list((ROOT / d).glob("torch-*+cpu-*.whl"))), None) if target == "cpu" else None
    mine = inputs(target)
    full = blocks(compile_(mine + t["base"], target, hashes=True, find_links=find_links))
    header = [f"# requirements/{target}.lock: generated by scripts/lock.py with uv {UV_VERSION}; do not edit.",
              f"# inputs-sha256: {inputs_sha256(target)}",
              f"# resolved from: pyproject.toml's dependencies with {', '.join(TARGETS[target]['pins'])}"
              + (f", {t['torch']}" if t["torch"] else "") + (f", {t['faiss']}" if t["faiss"] else "")]
    if t["base"]:
        # what prorag needs, without the base: the packages only the base's pins bring are the base image's
        ours = set(blocks(compile_(mine + [b for b in t["base"] if req_name(b) == "torch"], target, hashes=False,
                                   find_links=None)))
        left = sorted(n for n in full if n not in ours or BASE_ONLY.match(n))
        header += [f"# together with the base image's {', '.join(t['base'])}, which it provides with everything only",
                   "# they need. Left to the base (not installed from here):"]
        header += ["#   " + line for line in textwrap.wrap(", ".join(left), 110)]
        full = {n: b for n, b in full.items() if n not in left}
    else:
        header.append(f"# python {PYTHON}, linux x86_64 (manylinux_2_28)")
    text = "\n".join(header) + "\n" + "\n".join(line for n in sorted(full) for line in full[n]) + "\n"
    path = OUT / f"{target}.lock"
    path.write_text(text)
    return path


def recorded_sha256(path: Path) -> str | None:
    m = re.search(r"^# inputs-sha256: ([0-9a-f]{64})$", path.read_text(), re.M) if path.is_file() else None
    return m.group(1) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare the recorded inputs with the current ones")
    ap.add_argument("targets", nargs="*", default=list(TARGETS))
    args = ap.parse_args()
    stale = [t for t in args.targets if recorded_sha256(OUT / f"{t}.lock") != inputs_sha256(t)]
    if args.check:
        for t in stale:
            print(f"requirements/{t}.lock is stale: run python scripts/lock.py {t}", file=sys.stderr)
        return 1 if stale else 0
    OUT.mkdir(exist_ok=True)
    for t in args.targets:
        print(lock(t).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
