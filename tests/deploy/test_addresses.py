"""One address scheme: every service address in configs/ (and the ones compose and k8s hand the trainer's jobs)
resolves to the right service and port in compose's both profiles and in every kustomization.

A service address is a gRPC target (`host:port` or `dns:///host:port`) in a field named after the service it must
reach (retriever, policy, prm, judge, trainer). The names resolve in compose as service names or network aliases,
in Kubernetes as Services (in the trainer's namespace); the port must be the service's own (paths.GRPC_PORTS), and
a Kubernetes Service must select that service's pods and expose the port.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from prorag import paths
from tests.deploy.test_manifests import ROOT, SERVICE_ADDRESSES, _by_kind, base_name, load_compose, profile_services

TARGET = re.compile(r"^(?:dns:///)?(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d+)$")
ADDRESS_FIELDS = set(paths.SERVICES)


def config_files() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").rglob("*") if p.suffix in (".json", ".yaml", ".yml"))


def addresses(node, where: str = "") -> list[tuple[str, str, str]]:
    """(where, field, target) for every string that is a gRPC target, and for every address field's value."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and (TARGET.match(v) or (k in ADDRESS_FIELDS and v)):
                out.append((f"{where}.{k}".lstrip("."), k, v))
            else:
                out += addresses(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += addresses(v, f"{where}[{i}]")
    return out


def compose_names(profile: str) -> dict[str, set[str]]:
    """service -> every name it answers to in that profile's network."""
    out = {}
    for name, svc in profile_services(load_compose("compose.yaml"), profile).items():
        if base_name(name) in paths.SERVICES:
            aliases = ((svc.get("networks") or {}).get("default") or {}).get("aliases") or []
            out[base_name(name)] = {name, *aliases}
    return out


def k8s_names(objs: list[dict]) -> dict[str, dict[str, set[int]]]:
    """service -> {Service name: its ports}, each Service assigned to the service whose pods it selects."""
    out: dict[str, dict[str, set[int]]] = {}
    deployments = _by_kind(objs, "Deployment")
    for sname, svc in _by_kind(objs, "Service").items():
        (target,) = [d.removeprefix("prorag-") for d, dep in deployments.items()
                     if svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
        out.setdefault(target, {})[sname] = {p["port"] for p in svc["spec"]["ports"]}
    return out


@pytest.fixture(scope="module")
def deployments(rendered) -> dict[str, object]:
    return {"compose:" + p: compose_names(p) for p in ("cpu", "gpu")} | \
        {"k8s:" + k: k8s_names(objs) for k, objs in rendered.items()}


def unresolved(field: str, target: str, deployments: dict) -> list[str]:
    m = TARGET.match(target)
    if not m:
        return [f"{target!r} is not host:port or dns:///host:port"]
    if field not in ADDRESS_FIELDS:
        return [f"{target!r} sits in {field!r}, which names no service"]
    host, port = m.group("host"), int(m.group("port"))
    errors = []
    if port != paths.GRPC_PORTS[field]:
        owner = [s for s, p in paths.GRPC_PORTS.items() if p == port]
        errors.append(f"port {port} is {owner[0] if owner else 'no service'}'s, {field} listens on "
                      f"{paths.GRPC_PORTS[field]}")
    for where, names in deployments.items():
        if where.startswith("compose:"):
            if host not in names.get(field, set()):
                errors.append(f"{where}: {host} is not a name of {field} ({sorted(names.get(field, []))})")
        elif port not in names.get(field, {}).get(host, set()):
            errors.append(f"{where}: no Service {host} with port {port} selecting {field}'s pods "
                          f"({ {n: sorted(p) for n, p in names.get(field, {}).items()} })")
    return errors


def test_every_config_in_configs_addresses_services_that_exist_everywhere(deployments):
    files = config_files()
    assert any(f.parent.name == "paper" for f in files)
    found, errors = 0, []
    for f in files:
        data = json.loads(f.read_text()) if f.suffix == ".json" else yaml.safe_load(f.read_text())
        for where, field, target in addresses(data):
            found += 1
            errors += [f"{f.relative_to(ROOT)} {where}={target!r}: {e}" for e in unresolved(field, target, deployments)]
    assert found >= 9, "the paper configs name the services they call"
    assert not errors, "\n".join(errors)


def test_what_the_trainer_fills_in_resolves_everywhere(deployments, rendered):
    """The trainer's service_addresses (what a job gets for the fields it leaves unset) are one set of names for
    compose and k8s, and each resolves in both."""
    compose = load_compose("compose.yaml")
    for name in ("trainer", "trainer-cpu"):
        cmd = compose["services"][name]["command"]
        assert json.loads(cmd[cmd.index("--set") + 1].split("=", 1)[1]) == SERVICE_ADDRESSES
    for k, objs in rendered.items():
        args = _by_kind(objs, "Deployment")["prorag-trainer"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert json.loads(args[args.index("--set") + 1].split("=", 1)[1]) == SERVICE_ADDRESSES, k
    errors = [f"{field}={t!r}: {e}" for field, t in SERVICE_ADDRESSES.items()
              for e in unresolved(field, t, deployments)]
    assert not errors, "\n".join(errors)


def test_the_check_catches_what_it_is_for(deployments):
    # the two mistakes configs/paper had: the judge on the trainer's port, and a compose-only name
    assert any("port 50055 is trainer's" in e for e in unresolved("judge", "prorag-judge:50055", deployments))
    assert any(e.startswith("k8s:") for e in unresolved("prm", "prm:50053", deployments))
    assert any(e.startswith("compose:") for e in unresolved("policy", "dns:///policy-headless:50052", deployments))
    assert unresolved("policy", "dns:///prorag-policy-headless:50052", deployments) == []
    assert addresses({"a": {"judge": "judge:50055"}, "b": [{"x": "dns:///h:1"}], "prm": ""}) == \
        [("a.judge", "judge", "judge:50055"), ("b[0].x", "x", "dns:///h:1")]
