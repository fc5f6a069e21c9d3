"""Images that build the same twice: the hashed lockfiles in requirements/ (written by scripts/lock.py), the
Dockerfile's dependency layer that installs from them and nothing else, base images pinned by digest or marked, and
the version table of docs/DEPLOY.md. Checked without a network, a Docker engine or a GPU (the CPU image's build from
cpu.lock is `make smoke-containers`; regenerating the locks needs PyPI: `python scripts/lock.py`)."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.deploy.test_manifests import ROOT, dockerfile_stages, load_compose, profile_services

LOCKS = ROOT / "requirements"


@lru_cache(maxsize=None)
def lock_script():
    spec = importlib.util.spec_from_file_location("prorag_lock_script", ROOT / "scripts" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TARGETS = tuple(lock_script().TARGETS)
GPU_TARGETS = tuple(t for t in TARGETS if t != "cpu")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@lru_cache(maxsize=None)
def parse_lock(target: str) -> dict[str, list[tuple[str, str, list[str]]]]:
    """{name: [(version, marker, [sha256, ...]), ...]}; a package may appear once per marker. Fails on any line
    that pip's --require-hashes mode would refuse or that is not an exact pin."""
    text = (LOCKS / f"{target}.lock").read_text()
    out: dict[str, list[tuple[str, str, list[str]]]] = {}
    entries = re.split(r"\n(?=[^\s#])", "\n".join(line for line in text.splitlines() if not line.startswith("#")))
    for entry in (e.strip() for e in entries if e.strip()):
        first = entry.splitlines()[0].rstrip(" \\")
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(?:\s*;\s*(.+))?", first)
        assert m, f"{target}.lock: not an exact pin: {first!r}"
        hashes = HASH.findall(entry)
        assert hashes, f"{target}.lock: {first} has no sha256"
        leftover = HASH.sub("", entry.replace(first, "", 1)).replace("\\", "")
        assert not re.sub(r"#.*", "", leftover).strip(), f"{target}.lock: unexpected text in {first}'s entry"
        out.setdefault(lock_script().canon(m.group(1)), []).append((m.group(2), m.group(3) or "", hashes))
    return out


def versions(target: str, name: str) -> set[str]:
    return {v for v, _, _ in parse_lock(target).get(name, [])}


def project_requirements() -> list[Requirement]:
    return [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


@pytest.mark.parametrize("target", TARGETS)
def test_every_lock_is_there_fresh_pinned_and_hashed(target):
    """Each lock exists, was written from today's pyproject.toml and pins (its recorded inputs-sha256 is that of
    the current inputs: editing a dependency without `python scripts/lock.py` fails here), and every entry is an exact
    version with sha256 digests, which is what `pip install --require-hashes` demands."""
    path = LOCKS / f"{target}.lock"
    assert path.is_file(), f"{path} missing: python scripts/lock.py"
    assert lock_script().recorded_sha256(path) == lock_script().inputs_sha256(target), \
        f"requirements/{target}.lock is stale: run python scripts/lock.py {target}"
    assert len(parse_lock(target)) > 50
    assert set(LOCKS.glob("*.lock")) == {LOCKS / f"{t}.lock" for t in TARGETS}, "a lock no target writes"


@pytest.mark.parametrize("target", TARGETS)
def test_the_locks_hold_what_pyproject_asks(target):
    """Every dependency of pyproject.toml is in the lock at a version its specifier admits (torch in the CPU lock
    only: the GPU bases bring theirs; faiss-gpu-cu12 in faiss-cpu's place in the GPU retriever's)."""
    lock = parse_lock(target)
    faiss_gpu = lock_script().TARGETS[target]["faiss"]
    for req in project_requirements():
        name = lock_script().canon(req.name)
        if name == "torch" and target != "cpu":
            assert name not in lock, f"{target}.lock re-installs the base's torch"
            continue
        if name == "faiss-cpu" and faiss_gpu:
            assert "faiss-cpu" not in lock, "faiss-cpu and faiss-gpu both install the module faiss"
            name, req = "faiss-gpu-cu12", Requirement(faiss_gpu)
        assert name in lock, f"{target}.lock lacks {req}"
        for version, _, _ in lock[name]:
            assert req.specifier.contains(Version(version), prereleases=True), (target, str(req), version)


def test_the_cpu_lock_is_the_cpu_build_of_torch():
    """cpu.lock installs torch 2.13.0's CPU build (pyproject's pin) and none of the CUDA wheels PyPI's build pulls."""
    assert versions("cpu", "torch") == {"2.13.0+cpu"}
    assert not [n for n in parse_lock("cpu") if re.match(r"^(nvidia-|cuda-|triton)", n)]
    assert versions("cpu", "transformers") == {"5.24.0"} and "faiss-cpu" in parse_lock("cpu")


def test_the_torch_wheel_on_disk_is_the_locked_one():
    """Where the CPU wheel lies on this machine (the smoke puts it into the build context), its sha256 is the lock's:
    a build from it passes --require-hashes. Says so when there is none to compare."""
    wheels = [p for d in (ROOT / "build" / "wheels", Path("/opt/wheels")) for p in d.glob("torch-2.13.0+cpu-*.whl")]
    ((_, _, hashes),) = parse_lock("cpu")["torch"]
    for wheel in wheels:
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() in hashes, f"{wheel} is not the locked torch"
    if not wheels:
        print("no torch 2.13.0+cpu wheel on this machine: its hash was not compared")


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_gpu_locks_leave_the_cuda_stack_to_the_base(target):
    """A GPU lock never re-installs what its base image brings: torch, vLLM, triton, the nvidia-* and cuda-* wheels
    (a second torch or CUDA runtime in the venv would shadow the image's); the lock says what it leaves out."""
    lock = parse_lock(target)
    offending = [n for n in lock if lock_script().BASE_ONLY.match(n)]
    assert not offending, f"{target}.lock installs the base's {offending}"
    text = (LOCKS / f"{target}.lock").read_text()
    for pin in lock_script().TARGETS[target]["base"]:
        assert pin in text.split("\n# Left to the base")[0], f"{target}.lock does not record the base's {pin}"


def test_one_transformers_in_every_gpu_image_within_vllms_range():
    """What the trainer saves the policy loads: one transformers version in the three GPU locks, inside vLLM 0.33.0's
    declared range (>=5.16.1,<5.21: the lock resolved it together with vllm==0.33.0)."""
    found = {t: versions(t, "transformers") for t in GPU_TARGETS}
    assert len({v for vs in found.values() for v in vs}) == 1, found
    (version,) = found["vllm"]
    assert Version("5.16.1") <= Version(version) < Version("5.21"), version


def test_compose_builds_each_image_from_its_lock():
    compose = load_compose("compose.yaml")
    for profile in ("cpu", "gpu"):
        for name, svc in profile_services(compose, profile).items():
            if "build" not in svc:
                continue
            args = svc["build"]["args"]
            assert (LOCKS / args["LOCK"]).is_file(), (name, args["LOCK"])
            assert args["LOCK"].removesuffix(".lock") in TARGETS
            assert (args["FLAVOR"] == "cpu") == (args["LOCK"] == "cpu.lock"), name
    build_venv = (ROOT / "scripts" / "docker" / "build_venv.sh").read_text()
    for target in TARGETS:  # build_venv.sh accepts each lock with its flavor only
        flavor = "cpu" if target == "cpu" else "gpu"
        assert f"{flavor}:{target}.lock" in build_venv, target


def test_the_dependency_layer_is_the_locks_alone():
    """The builder copies only the lockfiles (and optional local wheels) before installing the dependencies, so the
    layer is rebuilt when a lock changes and never for a change of the code, pyproject.toml or README.md; the install
    is pip's --require-hashes --no-deps from the lock, nothing resolved at build time."""
    builder = dockerfile_stages()["builder"]
    before, _, after = builder.partition("RUN prorag-build-venv deps")
    assert after, "the builder installs the dependencies in a RUN of its own"
    copies = re.findall(r"^COPY (.+)$", before, re.M)
    assert copies == ["scripts/docker/build_venv.sh /usr/local/bin/prorag-build-venv", "requirements requirements",
                      "build/wheel[s] requirements/cpu.lock /wheels/"], copies
    for name in ("pyproject.toml", "README.md", "prorag", "services", "protos"):
        assert re.search(rf"^COPY .*\b{re.escape(name)}\b", after, re.M), f"{name} is copied after the dependencies"
    script = (ROOT / "scripts" / "docker" / "build_venv.sh").read_text()
    deps = script[script.index("deps() {"):script.index("project() {")]
    installs = re.findall(r"pip_install (.*)", deps)
    from_lock = [i for i in installs if '-r "$LOCKFILE"' in i]
    assert from_lock and all("--require-hashes --no-deps" in i for i in from_lock), installs
    assert "pyproject" not in deps, "the dependency step resolves nothing from pyproject.toml"
    # the rest is opt-in and said to be outside the lock
    assert [i for i in installs if i not in from_lock] and all(
        "FLASH_ATTN" in i or "EXTRA_PIP" in i or "ninja" in i for i in installs if i not in from_lock)


#: a base reference pinned by digest
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}\b")


def unpinned_bases(lines: list[str]) -> list[str]:
    """The lines that name a base image default (a Dockerfile `ARG BASE=` / `FROM <image>`, a compose `BASE:`) by tag
    alone without saying so: an image without a digest must carry the marker UNPINNED on its line or in the comment
    right above it."""
    bad = []
    for i, line in enumerate(lines):
        m = (re.match(r"^ARG (?:BUILDER_)?BASE=(\S+)", line) or re.match(r"^FROM (\S+)", line)
             or re.match(r"^\s*BASE: (\S+)", line))
        if not m:
            continue
        ref = m.group(1)
        default = re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", ref)
        if default.startswith("${") or default in ("runtime", "builder") or DIGEST.search(default):
            continue  # another argument, a stage, or pinned
        if "UNPINNED" not in line and not (i and lines[i - 1].lstrip().startswith("#") and "UNPINNED" in lines[i - 1]):
            bad.append(line.strip())
    return bad


def test_base_images_are_pinned_by_digest_or_marked():
    """No registry was reachable where these were written, so the digests of python:3.11-slim,
    pytorch/pytorch:2.14.0-cuda12.8-cudnn9-runtime and vllm/vllm-openai:v0.33.0 could not be read: each default
    says UNPINNED, and a digest is set through BASE / PRORAG_*_BASE (docs/DEPLOY.md). A new unmarked tag fails."""
    for path in (ROOT / "Dockerfile", ROOT / "compose.yaml", ROOT / "compose.train.yaml"):
        if path.is_file():
            assert unpinned_bases(path.read_text().splitlines()) == [], path.name
    # the rule itself: a plain tag fails, a digest or the marker passes
    assert unpinned_bases(["ARG BASE=python:3.11-slim"]) == ["ARG BASE=python:3.11-slim"]
    assert unpinned_bases(["  BASE: ${X:-vllm/vllm-openai:v0.33.0}"]) == ["BASE: ${X:-vllm/vllm-openai:v0.33.0}"]
    assert unpinned_bases(["ARG BASE=python:3.11-slim@sha256:" + "a" * 64, "FROM ${BASE} AS runtime",
                           "# UNPINNED: no registry", "FROM debian:bookworm", "FROM runtime AS judge"]) == []


def test_deploy_md_states_the_stack_and_the_host():
    """docs/DEPLOY.md has one table of each image's CUDA, minimum driver, torch, vLLM, flash-attn and faiss, whose
    locked versions are the locks', and the host disk and GPU memory a full set-up needs."""
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    m = re.search(r"^\| image \| base \| Python \| CUDA \| minimum driver \| torch \| vLLM \| flash-attn \| faiss \| "
                  r"transformers \| lock \|\n((?:\|.*\n)+)", deploy, re.M)
    assert m, "the version table"
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in m.group(1).splitlines()[1:]]
    by_lock = {row[-1].strip("`").removeprefix("requirements/"): row for row in rows}
    assert set(by_lock) == {f"{t}.lock" for t in TARGETS}, sorted(by_lock)
    for target in TARGETS:
        row = by_lock[f"{target}.lock"]
        (tf,) = versions(target, "transformers")
        assert tf in row[9], (target, row[9])
        faiss = "faiss-gpu-cu12" if lock_script().TARGETS[target]["faiss"] else "faiss-cpu"
        (fv,) = versions(target, faiss)
        assert fv in row[8], (target, row[8])
    assert "2.13.0+cpu" in by_lock["cpu.lock"][5]
    for heading in ("Host disk", "GPU memory"):
        assert re.search(rf"^#+ .*{heading}", deploy, re.M | re.I), heading
