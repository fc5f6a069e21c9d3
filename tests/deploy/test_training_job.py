"""Training beyond one machine: k8s/training (one trainer stage as a JobSet of NODES pods x GPUS_PER_NODE GPUs under
`accelerate launch`) and compose.train.yaml (the same on the GPUs of one host), checked without a cluster, a JobSet
controller, a Docker engine or a GPU.

Kubernetes: k8s/training rendered with kustomize v5 (as tests/deploy/test_manifests.py renders k8s/), the JobSet
validated against JobSet v0.12.0's CRD schema (vendored: tests/deploy/schemas/README.md) with the API server's strict
field validation, plus the JobSet webhook's own rules that matter here; its Job template and the built-in objects
with kubernetes-validate --strict at the oldest Kubernetes that JobSet release supports. Then what the launch needs:
the container's command run by sh with a stub `accelerate` and its arguments read back by accelerate's own launch
parser and validation (the torchrun arguments each pod gets), the stage one the launcher runs on several processes,
the ConfigMap's job.json a valid config of that stage whose grad_accum the process count divides, the claims the
base defines mounted where the services mount them, WORK_DIR on a claim every node can mount, the NetworkPolicies.
Compose: compose.yaml + compose.train.yaml against the vendored compose spec, the trainer-launch service against
compose.yaml's trainer, and its entrypoint run by sh the same way.
Nothing here starts a pod or a process group: that needs a cluster with GPUs and JobSet (docs/TRAINING.md).
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
from tests.deploy.test_manifests import (GPU_TOLERATION, JOBSET_MIN_K8S, NODE_LABEL, ROOT, _by_kind,
                                         _compose_binaries, load_compose, profile_services, render, shipped_node,
                                         validate_compose_schema)

HERE = Path(__file__).resolve().parent
TRAINING = ROOT / "k8s" / "training"
SCHEMA = HERE / "schemas" / "jobset.x-k8s.io_jobsets.v0.12.0.json"
# JOBSET_MIN_K8S (tests/deploy/test_manifests.py, which validates the services' manifests against it too): JobSet
# v0.12.0 supports the last three Kubernetes minors at its release (1.34-1.36), the floor the launch's objects are
# validated against
PARAMS = ("PRORAG_STAGE", "PRORAG_RUN", "NODES", "GPUS_PER_NODE")
WORK_ROOT = "/data/runs/launch"


# ====================================================================== JobSet's CRD schema
def crd_jsonschema(node, in_properties: bool = False):
    """A CRD's structural schema as JSON Schema, with what the API server adds under strict field validation (what
    `kubectl apply` asks for): an object that lists its properties refuses any other field unless it preserves
    unknown fields, and `nullable` admits null. CEL rules (x-kubernetes-validations) are not evaluated: the JobSet
    CRD's only create-time rule is about startupPolicy and dependsOn, which test_the_jobset_passes_the_webhook_rules
    keeps out."""
    if isinstance(node, list):
        return [crd_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    if in_properties:  # field names, not schema keywords
        return {k: crd_jsonschema(v) for k, v in node.items()}
    out = {k: crd_jsonschema(v, in_properties=k == "properties") for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def jobset_validator():
    import jsonschema

    vendored = json.loads(SCHEMA.read_text())
    assert (vendored["group"], vendored["kind"], vendored["version"]) == ("jobset.x-k8s.io", "JobSet", "v1alpha2")
    return jsonschema.Draft4Validator(crd_jsonschema(vendored["openAPIV3Schema"]))


def jobset_errors(obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in jobset_validator().iter_errors(obj)]


def test_the_vendored_schema_is_jobsets_and_rejects_what_the_api_server_rejects():
    vendored = json.loads(SCHEMA.read_text())
    assert vendored["commit"] == "f22e565ac3cc3265c7c45ef67ecffdc689af5d77" and "v0.12.0" in vendored["source"]
    minimal = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "x"},
               "spec": {"replicatedJobs": [{"name": "a", "replicas": 1, "template": {"spec": {"template": {
                   "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}}]}}
    assert jobset_errors(minimal) == []
    spec = minimal["spec"]
    for broken in ({**spec, "replicatedJob": []},                                      # a misspelt field
                   {**spec, "failurePolicy": {"maxRestarts": "3"}},                     # a string for an int
                   {**spec, "failurePolicy": {"rules": [{"name": "r", "action": "Retry"}]}},  # not an action
                   {**spec, "network": {"enableDNSHostname": True}},                    # misspelt nested field
                   {**spec, "replicatedJobs": [{"name": "a", "template": {"spec": {"template": {"spec": {
                       "containers": [{"name": "c", "image": "i", "resources": {"limits": {"cpu": [1]}}}]}}}}}]}):
        assert jobset_errors({**minimal, "spec": broken}), broken


# ====================================================================== rendering
def training_tree(tmp_path: Path, *, params: dict[str, str] | None = None, job: dict | None = None,
                  one_node: bool = False) -> Path:
    """k8s/ copied with k8s/training edited as docs/TRAINING.md tells a user to: train.env's values, job.json, the
    one-node component uncommented."""
    dest = tmp_path / "k8s"
    shutil.copytree(ROOT / "k8s", dest)
    training = dest / "training"
    if params:
        lines = (training / "train.env").read_text().splitlines()
        seen = set()
        for i, line in enumerate(lines):
            key = line.split("=", 1)[0]
            if not line.startswith("#") and key in params:
                lines[i] = f"{key}={params[key]}"
                seen.add(key)
        assert seen == set(params), f"train.env lacks {set(params) - seen}"
        (training / "train.env").write_text("\n".join(lines) + "\n")
    if job is not None:
        (training / "job.json").write_text(json.dumps(job))
    if one_node:
        text = (training / "kustomization.yaml").read_text()
        assert "\n# - one-node\n" in text, "the one-node line kustomization.yaml documents"
        (training / "kustomization.yaml").write_text(text.replace("\n# - one-node\n", "\n- one-node\n"))
    return training


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return render(TRAINING)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> list[dict]:
    return render(training_tree(tmp_path_factory.mktemp("one-node"), params={"NODES": "1"}, one_node=True))


def jobset_of(objs: list[dict]) -> dict:
    (js,) = _by_kind(objs, "JobSet").values()
    return js


def node_job(js: dict) -> dict:
    (rjob,) = js["spec"]["replicatedJobs"]
    return rjob


def pod_spec(js: dict) -> dict:
    return node_job(js)["template"]["spec"]["template"]["spec"]


def trainer(js: dict) -> dict:
    (ctr,) = pod_spec(js)["containers"]
    return ctr


def env_values(ctr: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in ctr["env"] if "value" in e}


def test_every_kustomization_under_k8s_training_is_rendered_here():
    found = {str(p.parent.relative_to(TRAINING)) for p in TRAINING.rglob("kustomization.yaml")}
    assert found == {".", "one-node"}, found  # "." by `shipped`, one-node by `one_node`


# ====================================================================== the JobSet and the objects around it
@pytest.mark.parametrize("layout", ["shipped", "one_node"])
def test_the_jobset_matches_jobsets_crd_schema(layout, request):
    js = jobset_of(request.getfixturevalue(layout))
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    errors = jobset_errors(js)
    assert not errors, f"{layout} against JobSet v0.12.0's CRD:\n" + "\n".join(errors)


def coordinator_endpoint(js: dict) -> str:
    """What the JobSet controller writes into the coordinator annotation (CoordinatorEndpoint in jobset v0.12.0's
    pkg/controllers/jobset_controller.go): <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>."""
    c = js["spec"]["coordinator"]
    subdomain = js["spec"].get("network", {}).get("subdomain") or js["metadata"]["name"]
    return f"{js['metadata']['name']}-{c['replicatedJob']}-{c.get('jobIndex', 0)}-{c.get('podIndex', 0)}.{subdomain}"


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("layout", ["shipped", "one_node"])
def test_the_jobset_passes_the_webhook_rules(layout, request):
    """What JobSet's admission webhook (pkg/webhooks/jobset_webhook.go, v0.12.0) refuses that the schema does not
    say, for the fields used here."""
    js = jobset_of(request.getfixturevalue(layout))
    spec, rjob = js["spec"], node_job(js)
    job = rjob["template"]["spec"]
    assert "startupPolicy" not in spec and "dependsOn" not in rjob  # the CRD's one create-time CEL rule
    # the coordinator: an Indexed Job with completions, indices in range, the endpoint a valid label value
    c = spec["coordinator"]
    assert c["replicatedJob"] == rjob["name"]
    assert job["completionMode"] == "Indexed" and "completions" in job
    assert 0 <= c["jobIndex"] < rjob["replicas"] and 0 <= c["podIndex"] < job["completions"]
    endpoint = coordinator_endpoint(js)
    assert len(endpoint) <= 63 and LABEL_VALUE.match(endpoint), endpoint
    # the longest pod name (plus the 5 random characters) is a DNS-1035 label
    pod = f"{js['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}-{job['completions'] - 1}-abcde"
    assert len(pod) <= 63 and DNS1035.match(pod), pod
    for rule in spec["failurePolicy"]["rules"]:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"]) and len(rule["name"]) <= 128
        assert set(rule.get("onJobFailureReasons", [])) <= {"BackoffLimitExceeded", "DeadlineExceeded",
                                                             "FailedIndexes", "MaxFailedIndexesExceeded",
                                                             "PodFailurePolicy"}
    # a network rendezvous: pods resolve each other by name before they are ready
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}


@pytest.mark.parametrize("layout", ["shipped", "one_node"])
def test_the_job_template_and_the_built_in_objects_validate_strictly(layout, request):
    import kubernetes_validate

    objs = request.getfixturevalue(layout)
    js = jobset_of(objs)
    # the Job the JobSet controller creates from the template (its name: <jobset>-<replicatedJob>-<index>)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{js['metadata']['name']}-node-0"},
           "spec": node_job(js)["template"]["spec"]}
    built_in = [o for o in objs if o["kind"] != "JobSet"]
    assert {o["kind"] for o in built_in} == {"ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    errors = []
    for obj in [job, *built_in]:
        try:
            kubernetes_validate.validate(obj, JOBSET_MIN_K8S, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, f"{layout} against Kubernetes {JOBSET_MIN_K8S}:\n" + "\n".join(errors)


def test_failures_restart_the_whole_launch(shipped):
    """A static rendezvous cannot take back one replaced pod: any pod's failure fails the Job (backoffLimit 0, no
    pod restarts in place), and the JobSet recreates every pod, which resume from WORK_DIR's last checkpoint."""
    js = jobset_of(shipped)
    job = node_job(js)["template"]["spec"]
    assert job["backoffLimit"] == 0 and pod_spec(js)["restartPolicy"] == "Never"
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1 and policy.get("restartStrategy", "Recreate") == "Recreate"
    # only a disruption (drain, preemption) skips the count: the Job's podFailurePolicy names it PodFailurePolicy
    (rule,) = policy["rules"]
    assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]


# ====================================================================== the launch command
STUB = "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$STUB_OUT\"\n"


def run_with_stub_accelerate(tmp_path: Path, argv: list[str], env: dict[str, str]) -> tuple[int, list[str], str]:
    """Run ``argv`` (a container's sh command) with `accelerate` a stub that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "accelerate").write_text(STUB)
    (bin_dir / "accelerate").chmod(0o755)
    out = tmp_path / "accelerate-args"
    out.unlink(missing_ok=True)
    r = subprocess.run(argv, env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(out)},
                       capture_output=True, text=True, timeout=30)
    return r.returncode, (out.read_text().splitlines() if out.exists() else []), r.stderr


def accelerate_launch(args: list[str], config_files: dict[str, Path], monkeypatch):
    """``accelerate launch ARGS`` as accelerate reads it: its own parser, its own validation of the command line
    against the config file (``config_files`` maps the container's paths to local copies), and the torchrun
    arguments and environment it then starts the processes with. Returns (args, env)."""
    import accelerate.utils.launch as accelerate_launch_utils
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert args[0] == "launch", args
    parsed = launch_command_parser().parse_args(args[1:])
    in_container = parsed.config_file
    assert in_container in config_files, f"--config_file {in_container} is not a file the container has"
    parsed.config_file = str(config_files[in_container])
    parsed, _, _ = _validate_launch_command(parsed)
    # rank 0 checks that the port is free on its own machine; this machine's ports say nothing about the pod's
    monkeypatch.setattr(accelerate_launch_utils, "is_port_in_use", lambda port: False)
    env = accelerate_launch_utils.prepare_multi_gpu_env(parsed)
    return parsed, env


def launch_in_pod(js: dict, configmap: dict, index: int, tmp_path: Path, monkeypatch):
    """The trainer container of pod ``index``: its command run with the environment the kubelet gives it."""
    ctr = trainer(js)
    assert ctr["command"][:2] == ["sh", "-c"] and len(ctr["command"]) == 3
    script = ctr["command"][2]
    # the kubelet expands $(NAME) of defined variables in command/args: the script must hold none (sh's own
    # $((...)) arithmetic is not one)
    defined = {e["name"] for e in ctr["env"]}
    assert not [m for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", script) if m in defined]
    env = env_values(ctr)
    (master,) = [e for e in ctr["env"] if e["name"] == "MASTER_ADDR"]
    assert master["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['jobset.sigs.k8s.io/coordinator']"
    env["MASTER_ADDR"] = coordinator_endpoint(js)
    env["JOB_COMPLETION_INDEX"] = str(index)  # the Job controller sets it in every container of an Indexed Job
    rc, args, err = run_with_stub_accelerate(tmp_path, ctr["command"], env)
    assert rc == 0, err
    # the ConfigMap's files, where the container mounts them
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    (config_vol,) = [v for v in pod_spec(js)["volumes"] if "configMap" in v]
    local = tmp_path / "config"
    local.mkdir(exist_ok=True)
    files = {}
    for key, text in configmap["data"].items():
        (local / key).write_text(text)
        files[f"{mounts[config_vol['name']]}/{key}"] = local / key
    return accelerate_launch(args, files, monkeypatch), files


@pytest.mark.parametrize("layout", ["shipped", "one_node"])
def test_each_pod_launches_its_share_of_the_processes(layout, request, tmp_path, monkeypatch):
    objs = request.getfixturevalue(layout)
    js = jobset_of(objs)
    env = env_values(trainer(js))
    nodes, per_node = int(env["NODES"]), int(env["GPUS_PER_NODE"])
    (configmap,) = [c for c in _by_kind(objs, "ConfigMap").values() if "job.json" in c["data"]]
    for index in range(nodes):
        (args, launch_env), files = launch_in_pod(js, configmap, index, tmp_path, monkeypatch)
        # accelerate's num_processes is the total; torchrun gets nodes x processes per node
        assert (args.num_machines, args.num_processes) == (nodes, nodes * per_node)
        assert int(args.nproc_per_node) == per_node
        if nodes > 1:
            assert (int(args.nnodes), int(args.node_rank)) == (nodes, index)
            assert args.rdzv_endpoint == f"{coordinator_endpoint(js)}:{env['MASTER_PORT']}"
        # FSDP2 from the mounted fsdp2.yaml (the launcher refuses FSDP version 1 and DeepSpeed)
        assert launch_env["ACCELERATE_USE_FSDP"] == "true" and launch_env["FSDP_VERSION"] == "2"
        assert args.module and args.training_script == "services.trainer.launch"
        stage, config, work_dir = args.training_script_args
        assert files[config] and (stage, work_dir) == (env["PRORAG_STAGE"], f"{WORK_ROOT}/{env['PRORAG_RUN']}")


def test_the_mounted_accelerate_config_is_the_projects(shipped):
    (configmap,) = [c for c in _by_kind(shipped, "ConfigMap").values() if "job.json" in c["data"]]
    assert configmap["data"]["fsdp2.yaml"] == (ROOT / "configs" / "accelerate" / "fsdp2.yaml").read_text(), \
        "k8s/training/fsdp2.yaml is a copy of configs/accelerate/fsdp2.yaml (kustomize reads nothing outside)"
    # the JobSet mounts the generated ConfigMap by its hashed name (kustomizeconfig.yaml)
    (vol,) = [v for v in pod_spec(jobset_of(shipped))["volumes"] if "configMap" in v]
    assert vol["configMap"]["name"] == configmap["metadata"]["name"] != "prorag-train-config"


# ====================================================================== the stage and its config
def stage_config(stage_name: str, raw: dict, tmp_path: Path, monkeypatch):
    """``raw`` checked as the launcher checks it (services.trainer.launch.run_stage): a valid config of the stage,
    every path it names under PRORAG_HOME=/data, every endpoint on the trainer's default allowlist. The GPU host's
    model directories do not exist here: validation sees empty stand-ins (as tests/test_paper_configs.py does).
    ``device`` stays "auto", which resolves to the CPU here and to each process's GPU in the pod."""
    from prorag import validation
    from prorag.validation import DEFAULT_ALLOWED_ENDPOINTS
    from services.trainer.launch import MULTI_PROCESS_STAGES
    from services.trainer.stages import check_job_config, get_stage, load_stage_modules, validate_config

    assert stage_name in MULTI_PROCESS_STAGES, f"{stage_name} runs on one process only"
    load_stage_modules()
    stage = get_stage(stage_name)
    monkeypatch.setenv("PRORAG_HOME", "/data")
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    check_job_config(stage, raw, roots=validation.data_roots(), allowed_endpoints=DEFAULT_ALLOWED_ENDPOINTS)
    local = {k: (str(tmp_path) if isinstance(v, str) and v.startswith("/data/") and not Path(v).exists() else v)
             for k, v in raw.items()}
    return validate_config(stage, local)


def processes_divide(grad_accum: int, nodes: int, per_node: int) -> bool:
    """run_loop gives every process grad_accum / processes of each step's micro-batches."""
    return grad_accum % (nodes * per_node) == 0


@pytest.mark.parametrize("layout", ["shipped", "one_node"])
def test_the_stage_and_its_config_suit_the_launch(layout, request, tmp_path, monkeypatch):
    from prorag import validation

    objs = request.getfixturevalue(layout)
    js = jobset_of(objs)
    env = env_values(trainer(js))
    (configmap,) = [c for c in _by_kind(objs, "ConfigMap").values() if "job.json" in c["data"]]
    raw = json.loads(configmap["data"]["job.json"])
    cfg = stage_config(env["PRORAG_STAGE"], raw, tmp_path, monkeypatch)
    nodes, per_node = int(env["NODES"]), int(env["GPUS_PER_NODE"])
    assert processes_divide(cfg.grad_accum, nodes, per_node), \
        f"grad_accum {cfg.grad_accum} and {nodes} nodes x {per_node} GPUs"
    validation.check_name("PRORAG_RUN", env["PRORAG_RUN"])  # it becomes the job id: a path part and a version
    # the parameters reached every field that carries them
    job = node_job(js)["template"]["spec"]
    assert job["parallelism"] == job["completions"] == nodes
    res = trainer(js)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == per_node
    if layout == "one_node":
        assert nodes == 1


def test_the_shipped_job_is_the_papers_sft(shipped):
    (configmap,) = [c for c in _by_kind(shipped, "ConfigMap").values() if "job.json" in c["data"]]
    env = env_values(trainer(jobset_of(shipped)))
    assert env["PRORAG_STAGE"] == "sft"
    assert json.loads(configmap["data"]["job.json"]) == json.loads((ROOT / "configs/paper/sft.json").read_text()), \
        "k8s/training/job.json is a copy of configs/paper/sft.json"
    assert int(env["NODES"]) > 1, "the shipped launch spans nodes"


def test_the_checks_refuse_what_would_fail(tmp_path, monkeypatch):
    from prorag.errors import InvalidArgument

    assert not processes_divide(8, 2, 8) and not processes_divide(8, 1, 3) and processes_divide(8, 2, 4)
    raw = json.loads((ROOT / "configs/paper/sft.json").read_text())
    with pytest.raises(AssertionError, match="one process"):
        stage_config("mcts", json.loads((ROOT / "configs/paper/mcts.json").read_text()), tmp_path, monkeypatch)
    with pytest.raises(InvalidArgument, match="grad_acum"):
        stage_config("sft", {**raw, "grad_acum": 8}, tmp_path, monkeypatch)
    with pytest.raises(InvalidArgument, match="base_model"):
        stage_config("sft", {**raw, "base_model": "/etc"}, tmp_path, monkeypatch)


def test_the_launcher_refuses_a_process_count_that_does_not_divide_grad_accum(tmp_path, monkeypatch):
    """Before any model is loaded: run_loop would refuse it only at its first step, after every node loaded the
    model."""
    from types import SimpleNamespace

    from services.trainer.launch import run_stage

    monkeypatch.setenv("PRORAG_HOME", str(tmp_path))
    monkeypatch.delenv("PRORAG_DATA", raising=False)
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    (tmp_path / "model").mkdir()
    raw = {**json.loads((ROOT / "configs/paper/sft.json").read_text()), "base_model": str(tmp_path / "model")}
    with pytest.raises(SystemExit, match=r"grad_accum \(8\) is not a multiple of the 3 launched processes"):
        run_stage("sft", raw, tmp_path / "work", SimpleNamespace(num_processes=3))
    assert not (tmp_path / "work").exists(), "refused before the work directory is touched"


# ====================================================================== parameters
def test_the_parameters_are_one_file(tmp_path):
    """train.env alone moves the stage, the run, the nodes and the GPUs of every field that carries them."""
    rft = {**json.loads((ROOT / "configs/paper/rft.json").read_text()), "base_model": "sft@sft-8b"}
    objs = render(training_tree(tmp_path, params={"PRORAG_STAGE": "rft", "PRORAG_RUN": "rft-1", "NODES": "4",
                                                  "GPUS_PER_NODE": "2"}, job=rft))
    js = jobset_of(objs)
    env = env_values(trainer(js))
    assert {k: env[k] for k in PARAMS} == {"PRORAG_STAGE": "rft", "PRORAG_RUN": "rft-1", "NODES": "4",
                                           "GPUS_PER_NODE": "2"}
    job = node_job(js)["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    assert trainer(js)["resources"]["limits"]["nvidia.com/gpu"] == 2
    (configmap,) = [c for c in _by_kind(objs, "ConfigMap").values() if "job.json" in c["data"]]
    assert json.loads(configmap["data"]["job.json"]) == rft
    assert not _by_kind(objs, "ConfigMap").get("prorag-train-params"), "the parameters are not applied"
    assert jobset_errors(js) == []


def test_the_one_node_launch_follows_the_services_node(tmp_path):
    """The one-node launch selects the node k8s/components/one-node/node.env names, the same file the services'
    one-node layout reads: one place for both, and the parameter itself is not applied."""
    training = training_tree(tmp_path, params={"NODES": "1"}, one_node=True)
    (training.parent / "components" / "one-node" / "node.env").write_text("node=gpu-7\n")
    objs = render(training)
    assert pod_spec(jobset_of(objs))["nodeSelector"] == {NODE_LABEL: "gpu-7"}
    assert "prorag-node" not in _by_kind(objs, "ConfigMap")
    assert jobset_errors(jobset_of(objs)) == []


# ====================================================================== volumes, addresses, network
def mounts_by_claim(pod: dict, ctr: dict) -> dict[str, str]:
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    return {claims[m["name"]]: m["mountPath"] for m in ctr["volumeMounts"] if m["name"] in claims}


@pytest.mark.parametrize("layout,services", [("shipped", "overlays/gpu"), ("one_node", "overlays/gpu-one-node")])
def test_the_volumes_are_the_bases_claims_where_the_services_mount_them(layout, services, request, rendered):
    objs = request.getfixturevalue(layout)
    js = jobset_of(objs)
    pod, ctr = pod_spec(js), trainer(js)
    env = env_values(ctr)
    mine = mounts_by_claim(pod, ctr)
    own = _by_kind(objs, "PersistentVolumeClaim")
    base_claims = _by_kind(rendered["base"], "PersistentVolumeClaim")
    layout_claims = _by_kind(rendered[services], "PersistentVolumeClaim")
    base_trainer = _by_kind(rendered["base"], "Deployment")["prorag-trainer"]["spec"]["template"]["spec"]
    where = mounts_by_claim(base_trainer, base_trainer["containers"][0])
    assert set(mine) <= set(base_claims) | set(own), set(mine) - set(base_claims) - set(own)
    assert not set(own) & set(base_claims), "the launch defines no claim the base defines"
    assert {"prorag-data", "prorag-models", "prorag-adapters"} <= set(mine)
    # the services' runs/ claim is the trainer Deployment's alone (and ReadWriteOnce)
    assert "prorag-runs" not in mine
    for claim, path in mine.items():
        if claim in base_claims:
            assert path == where[claim], (claim, path, where[claim])
    # WORK_DIR lies on the launch's own claim
    (work_claim,) = [c for c, p in mine.items() if c in own and p == WORK_ROOT]
    assert f"{WORK_ROOT}/{env['PRORAG_RUN']}".startswith(WORK_ROOT + "/")
    nodes = int(env["NODES"])
    assert "affinity" not in pod
    # GPU nodes are commonly tainted: the launch tolerates it as every pod of the GPU layouts does
    assert pod["tolerations"] == [GPU_TOLERATION]
    for claim in mine:
        modes = (own.get(claim) or layout_claims[claim])["spec"]["accessModes"]
        if layout == "shipped":
            # pods on several nodes mount every claim at once: all ReadWriteMany in the services' RWX layout
            assert nodes > 1 and modes == ["ReadWriteMany"], (claim, modes)
        else:
            assert modes == ["ReadWriteOnce"], (claim, modes)
    if layout == "shipped":
        assert "nodeSelector" not in pod
        (layout_class,) = {c["spec"].get("storageClassName") for c in layout_claims.values()}
        assert own[work_claim]["spec"]["storageClassName"] == layout_class, "the layout's one class parameter"
    else:
        # on the node of the services' pods: the one the user labelled, named in the one place both read
        one_node_dep = _by_kind(rendered[services], "Deployment")["prorag-trainer"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == one_node_dep["nodeSelector"] == {NODE_LABEL: shipped_node()}
        assert "storageClassName" not in own[work_claim]["spec"]


TARGET = re.compile(r"^(?:dns:///)?(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d+)$")


def test_the_jobs_addresses_are_services_of_the_cluster(shipped, rendered):
    (configmap,) = [c for c in _by_kind(shipped, "ConfigMap").values() if "job.json" in c["data"]]
    raw = json.loads(configmap["data"]["job.json"])
    services = _by_kind(rendered["overlays/gpu"], "Service")
    found = 0
    for field in set(paths.SERVICES) & set(raw):
        if not raw[field]:
            continue
        m = TARGET.match(raw[field])
        assert m, (field, raw[field])
        host, port = m.group("host"), int(m.group("port"))
        assert port == paths.GRPC_PORTS[field], (field, raw[field])
        assert host in services and port in {p["port"] for p in services[host]["spec"]["ports"]}, (field, raw[field])
        found += 1
    assert found, "the shipped job calls a service"


def _selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_the_launch_reaches_the_services_and_its_peers(shipped, rendered):
    labels = node_job(jobset_of(shipped))["template"]["spec"]["template"]["metadata"]["labels"]
    policies = _by_kind(rendered["overlays/gpu"], "NetworkPolicy")
    # the base denies ingress to every prorag pod, these included ...
    assert _selects(policies["prorag-default-deny-ingress"]["spec"]["podSelector"], labels)
    # ... so the launch's pods reach each other through their own policy, on every port
    (peers,) = _by_kind(shipped, "NetworkPolicy").values()
    assert _selects(peers["spec"]["podSelector"], labels)
    (rule,) = peers["spec"]["ingress"]
    assert "ports" not in rule and any(_selects(p["podSelector"], labels) for p in rule["from"])
    # and every service the stages call lets them in
    for service in ("retriever", "policy", "prm", "judge"):
        (rule,) = policies[f"prorag-{service}"]["spec"]["ingress"]
        assert any(_selects(p["podSelector"], labels) for p in rule["from"]), service


def test_shared_memory_and_sizes(shipped):
    pod = pod_spec(jobset_of(shipped))
    res = trainer(jobset_of(shipped))["resources"]
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer(jobset_of(shipped))["volumeMounts"]

    def gib(q: str) -> float:
        assert q.endswith("Gi"), q
        return float(q[:-2])

    # /dev/shm counts against the memory limit; node 0 gathers the FULL_STATE_DICT checkpoint (~98 GB) on the CPU
    assert gib(res["limits"]["memory"]) >= gib(res["requests"]["memory"]) + gib(dshm["emptyDir"]["sizeLimit"])
    assert gib(res["requests"]["memory"]) * 2 ** 30 >= 8.19e9 * 12 * 1.2


# ====================================================================== compose.train.yaml
FILES = ("compose.yaml", "compose.train.yaml")


@pytest.fixture(scope="module")
def compose_train() -> dict:
    return load_compose(*FILES)


def test_compose_train_matches_the_compose_spec_schema():
    for env in ({}, {"LAUNCH_GPUS": "0,1,2,3,4,5,6,7", "PRORAG_TAG": "v1"}):
        errors = validate_compose_schema(load_compose(*FILES, env=env))
        assert not errors, f"{FILES} with {env} against the compose spec:\n" + "\n".join(errors)


def test_compose_train_config_with_the_compose_binaries_present(tmp_path):
    """`config -q` of every binary on this machine (none is needed: the schema test always runs)."""
    binaries = _compose_binaries()
    for f in (*FILES, "configs", "services", "scripts", "pyproject.toml", "README.md", "Dockerfile"):
        (tmp_path / f).symlink_to(ROOT / f)
    for cmd in binaries:
        r = subprocess.run([*cmd, "-f", FILES[0], "-f", FILES[1], "--profile", "gpu", "--profile", "train", "config",
                            "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COMPOSE_PROJECT_NAME": "prorag-test"})
        assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr}"
    if not binaries:
        print("no compose binary here: validated against the vendored compose-spec schema only")


def _devices(svc: dict) -> list:
    return svc["deploy"]["resources"]["reservations"]["devices"]


def test_trainer_launch_is_the_trainer_on_its_own_gpus(compose_train):
    services = compose_train["services"]
    launch, svc_trainer = services["trainer-launch"], services["trainer"]
    # one-shot and outside both profiles: `up --profile gpu` never starts it, `run trainer-launch` does
    assert launch["profiles"] == ["train"] and launch["restart"] == "no"
    gpu = profile_services(compose_train, "gpu")
    for dep, cond in launch["depends_on"].items():
        assert dep in gpu and cond["condition"] == "service_healthy" and "healthcheck" in gpu[dep], dep
    # what compose.yaml's trainer has (anchors do not reach across files)
    assert launch["image"] == svc_trainer["image"]
    assert set(svc_trainer["volumes"]) <= set(launch["volumes"])
    assert set(launch["volumes"]) - set(svc_trainer["volumes"]) == {"./configs:/configs:ro"}
    assert svc_trainer["environment"].items() <= launch["environment"].items()
    for key in ("read_only", "tmpfs", "cap_drop", "security_opt"):
        assert launch[key] == svc_trainer[key], key
    # the GPUs: named by LAUNCH_GPUS (Docker refuses count together with device_ids), clear of the policy's and
    # the PRM's by default
    (device,) = _devices(launch)
    assert "count" not in device and device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    (ids,) = device["device_ids"]
    assert ids == launch["environment"]["LAUNCH_GPUS"]
    taken = {i for name in ("policy", "prm") for i in _devices(services[name])[0]["device_ids"][0].split(",")}
    assert not set(ids.split(",")) & taken, (ids, taken)
    moved = load_compose(*FILES, env={"LAUNCH_GPUS": "0,1"})["services"]["trainer-launch"]
    assert _devices(moved)[0]["device_ids"] == ["0,1"] and moved["environment"]["LAUNCH_GPUS"] == "0,1"


def compose_entrypoint(svc: dict) -> list[str]:
    """The entrypoint as the container gets it: compose turns $$ into $ (a lone $NAME it would substitute itself)."""
    entry = svc["entrypoint"]
    for part in entry:
        assert "$" not in re.sub(r"\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*(:?-[^}]*)?\}", "", part), \
            f"an unescaped $ in {part!r}: compose would substitute it"
    return [part.replace("$$", "$") for part in entry]


def test_trainer_launch_runs_accelerate_over_its_gpus(compose_train, tmp_path, monkeypatch):
    launch = compose_train["services"]["trainer-launch"]
    entry = compose_entrypoint(launch)
    assert entry[:2] == ["sh", "-c"]
    env = {k: str(v) for k, v in launch["environment"].items()}
    # without its three arguments it says how to call it
    rc, args, err = run_with_stub_accelerate(tmp_path, entry, env)
    assert rc == 2 and not args and "usage: trainer-launch STAGE CONFIG RUN" in err
    for gpus in (env["LAUNCH_GPUS"], "0", "0,1,2,3,4,5,6,7"):
        rc, args, err = run_with_stub_accelerate(tmp_path, [*entry, "sft", "/configs/paper/sft.json", "sft-8b"],
                                                 {**env, "LAUNCH_GPUS": gpus})
        assert rc == 0, err
        # /configs is ./configs (the bind mount)
        configs = {f"/configs/{p.relative_to(ROOT / 'configs')}": p for p in (ROOT / "configs").rglob("*")
                   if p.is_file()}
        parsed, launch_env = accelerate_launch(args, configs, monkeypatch)
        n = len(gpus.split(","))
        assert (parsed.num_machines, parsed.num_processes, int(parsed.nproc_per_node)) == (1, n, n)
        assert launch_env["ACCELERATE_USE_FSDP"] == "true" and launch_env["FSDP_VERSION"] == "2"
        assert parsed.module and parsed.training_script == "services.trainer.launch"
        assert parsed.training_script_args == ["sft", "/configs/paper/sft.json", f"{WORK_ROOT}/sft-8b"]
    # the default GPU count divides every paper config's grad_accum that has one
    n = len(env["LAUNCH_GPUS"].split(","))
    for f in sorted((ROOT / "configs" / "paper").glob("*.json")):
        k = json.loads(f.read_text()).get("grad_accum")
        assert k is None or processes_divide(k, 1, n), (f.name, k, n)
