"""The `prorag` command: world, index, data, serve, up, bench, run.

Interface relied on by outside tools (keep stable): `prorag up [--port-offset N]`,
`prorag serve <service> [--port N] [--http-port N] [--metrics-port N]`, `prorag bench <target> --json`
(last output line is one JSON object), and `runs/latest/results.json` from `prorag run`.

Each command imports what it runs inside its own handler, on purpose: every service process of a stack is a
`prorag serve <service>`, and importing the whole app there (pipeline, reports, benchmarks, stages) takes 7.6 s and
248 MB RSS against 0.33 s and 39 MB for this module alone (2-core EPYC, 2026-11-28).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from prorag import paths
from prorag.config import ConfigError, from_dict
from prorag.errors import NotFound, ProragError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here; all models are local files
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _parse_sets(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


# ---------------------------------------------------------------- world / index
def cmd_world(args) -> int:
    from prorag_app.embedded import ensure_world

    summary = ensure_world(args.name, args.size, args.seed, force=args.force)
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def cmd_index(args) -> int:
    from prorag_app.embedded import ensure_indexes

    meta = ensure_indexes(args.world, faiss_type=args.faiss, encoder=args.encoder, pooling=args.pooling,
                          query_prefix=args.query_prefix, doc_prefix=args.doc_prefix, corpus=args.corpus,
                          out=args.out, fp16=args.fp16)
    print(json.dumps(meta, indent=2, sort_keys=True, default=str))
    return 0


def cmd_setup(args) -> int:
    """The containers' one-shot setup (compose's setup services, the k8s setup Job): prorag_app.deploy_setup."""
    from prorag_app.deploy_setup import run

    return run(args.mode)


def cmd_prepare_model(args) -> int:
    from prorag_app.deploy_setup import SetupError, prepare_policy_model

    try:
        print(json.dumps(prepare_policy_model(args.src, args.out), indent=2))
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


def _job_record(job) -> dict:
    from prorag.rpc.clients_trainer import state_name

    return {"job_id": job.job_id, "stage": job.stage, "state": state_name(job.state), "step": job.step,
            "total_steps": job.total_steps, "outputs": dict(job.outputs), "error": job.error, "run_dir": job.run_dir}


def cmd_job(args) -> int:
    """Trainer jobs from a shell: a job config file (or '-': stdin, e.g. piped into `docker compose exec -T trainer`)
    with --set overrides, submitted to the trainer; --wait follows it to the end (exit 0 only if it SUCCEEDED)."""
    from prorag.rpc.clients_trainer import TrainerClient

    try:
        return _job(args, TrainerClient(args.trainer, timeout=60))
    except grpc.RpcError as e:  # the trainer's refusal (a bad config, an unknown job) or no trainer: said plainly
        print(f"error: trainer {args.trainer}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2


def _job(args, client) -> int:
    with client as tc:
        if args.job_cmd == "start":
            text = sys.stdin.read() if args.config == "-" else Path(args.config).read_text()
            try:
                config = json.loads(text)
            except json.JSONDecodeError as e:
                print(f"error: {args.config} is not a JSON job config ({e})", file=sys.stderr)
                return 2
            if not isinstance(config, dict):
                print(f"error: {args.config} is not a JSON object", file=sys.stderr)
                return 2
            config.update(_parse_sets(args.set))
            left = sorted(k for k, v in config.items() if isinstance(v, str) and "REPLACE_WITH_" in v)
            if left:  # configs/paper's placeholders for earlier jobs' outputs
                print(f"error: fill in {', '.join(left)} (--set {left[0]}=...): still {config[left[0]]!r}",
                      file=sys.stderr)
                return 2
            job = tc.start(args.stage, config, job_id=args.job_id)
        else:
            job = tc.get(args.job_id)
        if args.wait:
            job = tc.wait(job.job_id, timeout=args.timeout or None)
        print(json.dumps(_job_record(job)))
    return 0 if not args.wait or _job_record(job)["state"] == "SUCCEEDED" else 1


def cmd_data(args) -> int:
    """`prorag data import`: a multi-hop QA dataset into the question format, hops aligned to corpus passages."""
    from prorag_app.data_import import DataImportArgs, run_import

    report = run_import(DataImportArgs(dataset=args.dataset, input=args.file, corpus=args.corpus or "",
                                       index_root=args.index_root or "", out=args.out or "", limit=args.limit,
                                       teacher_url=args.teacher_url or "", teacher_model=args.teacher_model))
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


def cmd_base(args) -> int:
    """Build (or find) the world's embedded base policy and print its directory: what a policy server serves
    and SFT starts from when no other model is given."""
    from prorag_app.embedded import ensure_policy_model

    # stdout is the directory alone (scripts read it); where the base came from goes to stderr
    print(ensure_policy_model(args.world, source=args.source, say=lambda line: print(line, file=sys.stderr)))
    return 0


# ---------------------------------------------------------------- serve / up
def _service_config(service: str, args) -> dict:
    data = {}
    if getattr(args, "config", None):
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
    data.update(_parse_sets(getattr(args, "set", None)))
    return data


async def _serve(service: str, args) -> None:
    from prorag.rpc.service import ServeConfig

    default_http = paths.HTTP_PORTS.get(service, -1)
    serve = from_dict(ServeConfig, {
        "host": args.host,
        "port": paths.GRPC_PORTS[service] if args.port is None else args.port,
        "http_port": default_http if args.http_port is None else args.http_port,
        "metrics_port": paths.METRICS_PORTS[service] if args.metrics_port is None else args.metrics_port,
        "tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_client_ca": args.tls_client_ca,
        "auth_tokens": args.auth_tokens,
        **({"max_concurrent_rpcs": args.max_concurrent_rpcs} if args.max_concurrent_rpcs is not None else {}),
    })
    from prorag.rpc.service import start_metrics

    # first, so a slow model load is watched too; the documented default port may be held by another local
    # service: then this one runs without metrics (a port given with --metrics-port must be free)
    metrics_port, stop_metrics = start_metrics(serve, service, required=args.metrics_port is not None)
    overrides = _service_config(service, args)
    if service == "retriever":
        from services.retriever.server import RetrieverConfig, start

        cfg = from_dict(RetrieverConfig, overrides)
        if not cfg.index_root:
            from prorag_app.embedded import ensure_indexes

            # build only what the default index reads: a BM25-only retriever must start where faiss or the
            # encoder's weights are missing (a lent GPU machine without network has neither)
            ensure_indexes(cfg.world, dense=cfg.default_index != "bm25", bm25=cfg.default_index != "dense")
        started = await start(serve, cfg)
    elif service == "policy":
        from services.policy.server import PolicyConfig, start

        overrides.setdefault("retriever", f"127.0.0.1:{paths.GRPC_PORTS['retriever'] + args.port_offset}")
        started = await start(serve, from_dict(PolicyConfig, overrides))
    elif service == "prm":
        from services.prm.server import PRMServeConfig, start

        started = await start(serve, from_dict(PRMServeConfig, overrides))
    elif service == "judge":
        from services.judge.server import JudgeConfig, start

        cfg = from_dict(JudgeConfig, overrides)
        from prorag_app.embedded import ensure_world

        ensure_world(cfg.world)
        started = await start(serve, cfg)
    elif service == "trainer":
        from services.trainer.server import TrainerConfig, start

        started = await start(serve, from_dict(TrainerConfig, overrides))
    else:
        if overrides:
            raise ConfigError(next(iter(overrides)), f"the {service} service takes no settings yet")
        module = __import__(f"services.{service}.server", fromlist=["start"])
        started = await module.start(serve)
    http = f", HTTP on {serve.host}:{started.http_port}" if started.http_port else ""
    metrics = f", metrics on http://{serve.host}:{metrics_port}/metrics" if metrics_port else ""
    print(f"{service}: gRPC on {serve.host}:{started.grpc_port}{http}{metrics}", flush=True)
    from prorag.rpc.grpc_server import serve_until_signal

    await serve_until_signal([started.stop, stop_metrics])


def cmd_health(args) -> int:
    """Exit 0 when the service answers SERVING over the gRPC health protocol (TLS and token from the env):
    what container health checks and Kubernetes exec probes run."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prorag.rpc.clients import channel

    target = args.target or f"127.0.0.1:{paths.GRPC_PORTS[args.service_of] if args.service_of else 50051}"
    try:
        with channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                        timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{target} {args.service or '(process)'}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{target} {args.service or '(process)'}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_security_init(args) -> int:
    from prorag.rpc.security import DEFAULT_TLS_HOSTS, generate_secrets

    hosts = tuple(args.host) if args.host else DEFAULT_TLS_HOSTS
    files = generate_secrets(args.out, hosts=hosts, days=args.days)
    print(json.dumps(files, indent=2))
    print(f"servers: PRORAG_TLS_CERT={files['server_cert']} PRORAG_TLS_KEY={files['server_key']} "
          f"PRORAG_AUTH_TOKENS={files['tokens']} [PRORAG_TLS_CLIENT_CA={files['ca']} for mutual TLS]", file=sys.stderr)
    print(f"clients: PRORAG_TLS_CA={files['ca']} PRORAG_TOKEN_FILE={files['token_client']} (admin: "
          f"{files['token_admin']}) [PRORAG_TLS_CLIENT_CERT={files['client_cert']} "
          f"PRORAG_TLS_CLIENT_KEY={files['client_key']}]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from prorag.rpc.observability import configure_logging

    configure_logging(args.service, args.log_format)
    asyncio.run(_serve(args.service, args))
    return 0


def served_policy(world: str, model: str | None) -> str:
    """What `prorag up` serves: ``model`` when given (a directory or a published name[@version]), else the newest
    trained agent `prorag run` published for the world (sft), else the world's embedded base (built if missing)."""
    from prorag.registry import registry
    from prorag_app.embedded import ensure_policy_model

    models = registry("model", world)
    if model:
        return str(models.resolve(model))
    try:
        return str(models.resolve("sft"))
    except NotFound:
        return str(ensure_policy_model(world))


def served_prm(world: str, prm: str | None) -> tuple[str | None, str]:
    """What `prorag up`'s PRM service loads, and a line saying why: ``prm`` when given (name@version, a bare name
    = its newest version, or a directory; "none" = start empty), else the newest PRM published for the world under
    any name (what `make run`'s stage 2 trained), else nothing: the service starts empty (FAILED_PRECONDITION)."""
    from prorag.registry import registry

    prms = registry("prm", world)
    if prm is not None and prm.strip().lower() == "none":
        return None, "prm starts empty (--prm none): ScoreSteps answers FAILED_PRECONDITION until one is loaded"
    if prm:
        try:
            path = prms.resolve(prm)
        except NotFound as e:
            published = ", ".join(r.key for r in prms.list()) or "none"
            raise NotFound(f"--prm {prm}: {e}. Published for world {world!r}: {published}; "
                           f"or --prm none to start the PRM service empty") from None
        # a directory travels as an absolute path; a registry name is looked up by the service in the world's registry
        model = str(path.resolve()) if Path(prm).is_dir() else prm
        return model, f"prm serves {prm} (--prm)"
    published = prms.list()
    if not published:
        return None, (f"prm starts empty: no PRM is published for world {world!r} under {prms.root} (`make run`'s "
                      f"stage 2 trains one, or the trainer stage `prm`); ScoreSteps answers FAILED_PRECONDITION "
                      f"until then. `prorag up --prm name@version` serves a given one")
    # created_at has one-second resolution; the version (a job id) only breaks ties deterministically
    newest = max(published, key=lambda r: (prms.manifest(r).created_at, r.version, r.name))
    return newest.key, (f"prm serves {newest.key}, the newest of {len(published)} PRM(s) published for world "
                        f"{world!r} (--prm name@version picks another, --prm none starts it empty)")


def cmd_up(args) -> int:
    """Start all five services as local processes; Ctrl-C or SIGTERM stops them all."""
    from prorag_app.embedded import ensure_indexes
    from prorag_app.stack import ServiceStack

    prm_model, prm_why = served_prm(args.world, args.prm)  # a --prm that is not published fails before any build
    print(prm_why, flush=True)
    ensure_indexes(args.world, size=args.size)  # build what is missing before any service starts
    policy_model = served_policy(args.world, args.model)
    from prorag_app import procs

    # SIGTERM and Ctrl-C arrive as procs.Stopped (main installs the handlers, with the watchdog that SIGKILLs a
    # service still running after the grace period). That is how `up` is meant to end, while serving or while
    # still starting (a `docker stop` does not wait for readiness): every service is stopped and the exit code is 0
    stack = ServiceStack(host=args.host, port_offset=args.port_offset, world=args.world,
                         start_timeout=args.start_timeout,
                         overrides={"policy": {"model": policy_model},
                                    **({"prm": {"model": prm_model}} if prm_model else {})})
    try:
        with stack:
            print(f"all services up (policy serves {policy_model}):")
            for svc in paths.SERVICES:
                http = f"  {stack.http_url(svc)}" if svc in paths.HTTP_PORTS else ""
                print(f"  {svc:10s} grpc {stack.grpc_target(svc)}{http}")
            sys.stdout.flush()
            while True:
                dead = stack.dead()
                if dead:
                    print(f"{dead[0][0]} exited with code {dead[0][1]}; stopping the others", file=sys.stderr)
                    return 1
                time.sleep(0.2)
    except procs.Stopped as e:
        print(f"prorag up: {e}: every service stopped", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------- bench / run
def cmd_bench(args) -> int:
    from prorag_app.bench import BENCHES

    fn = BENCHES.get(args.target)
    if fn is None:
        raise SystemExit(f"unknown bench target {args.target!r}; known: {', '.join(BENCHES)}")
    result = fn(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def cmd_eval_prm(args) -> int:
    """`prorag eval prm`: gold steps against corrupted ones on a split, every corruption family (prorag.prm.evaluation),
    AUC per family and pooled, the gate's verdict and a PNG (prorag_app.eval.eval_prm)."""
    from prorag_app.eval import eval_prm

    return eval_prm(args)


def cmd_eval(args) -> int:
    from rich.console import Console

    if args.target == "prm":
        return cmd_eval_prm(args)

    from prorag.data.loaders import load_split
    from prorag_app.eval import evaluate, format_table, reader_settings
    from prorag.io import write_json
    from prorag.methods import DOCS_PER_SEARCH, METHODS
    from prorag.registry import published_config, registry
    from prorag.runs import new_run_dir, point_latest
    from prorag_app.stack import ServiceStack
    from prorag.rpc.clients import PolicyClient, RetrieverClient

    if args.topk < 0:
        raise SystemExit(f"--topk must be 1 or more (0 = as the model was trained), got {args.topk}")
    # a method that reads with another's model (standard_rag: the agent's) evaluates that model by default
    reader = METHODS[args.method].reader if args.method in METHODS else ""
    model = str(registry("model", args.world).resolve(args.model or reader or args.method))
    # as many documents per search as the model was trained with, unless asked otherwise
    topk = args.topk or published_config(model).get("topk") or DOCS_PER_SEARCH
    qs = load_split(paths.world_dir(args.world), args.split)
    qs = qs[:args.limit] if args.limit else qs
    out = Path(args.out) if args.out else new_run_dir(f"eval-{args.method}")
    services = ("policy",) if args.retriever else ("retriever", "policy")
    stack = ServiceStack(port_offset=args.port_offset, world=args.world, services=services,
                         log_dir=str(out / "logs"),
                         overrides={"policy": {"model": model,
                                               **({"retriever": args.retriever} if args.retriever else {})}})
    with stack:
        retr_target = args.retriever or stack.grpc_target("retriever")
        with PolicyClient(stack.grpc_target("policy")) as policy, RetrieverClient(retr_target, timeout=600) as retr:
            settings = {**(METHODS[args.method].evaluate if args.method in METHODS else {}), "topk": topk,
                        **reader_settings(args.method, model, published_config(model))}
            result = evaluate(args.method, policy, retr, qs, out_dir=out, **settings)
    write_json(out / "results.json", {"methods": {args.method: result}, "model": model, "split": args.split,
                                      "topk": topk})
    if not args.out:
        point_latest(out)
    Console().print(format_table({args.method: result}, args.split))
    print(json.dumps({"method": args.method, "model": model, "overall": result["overall"]}))
    return 0


def cmd_run(args) -> int:
    from prorag_app.pipeline import run_ablation, run_main_job
    from prorag_app.profiles import PLANS, PROFILES, with_overrides

    if args.policy_replicas < 0:
        raise SystemExit(f"--policy-replicas is {args.policy_replicas}: give 1 or more processes, or 0 for the "
                         "default (one per core up to 4 on a CPU host, 1 with a GPU)")
    if args.profile == "ablation":
        if args.stage34_seed is not None or args.beta is not None or args.set or args.split != "test":
            raise SystemExit("--profile ablation runs its own seeds and betas on the test split "
                             "(prorag_app.profiles.ABLATION); --stage34-seed, --beta, --set and --split are for "
                             "single runs")
        run_ablation(world=args.world, port_offset=args.port_offset, policy_replicas=args.policy_replicas)
        return 0
    if args.profile in PLANS and args.stage34_seed is None and args.beta is None:
        # a plan over seeds (research): every seed on --split with --set applied, then one report
        run_ablation(PLANS[args.profile], world=args.world, port_offset=args.port_offset, split=args.split,
                     overrides=tuple(args.set or ()), policy_replicas=args.policy_replicas)
        return 0
    prof = with_overrides(dataclasses.replace(PROFILES[args.profile], eval_split=args.split), args.set or [])
    run_main_job(profile=args.profile, world=args.world, port_offset=args.port_offset,
                 stage34_seed=args.stage34_seed, beta=args.beta, prof=prof, policy_replicas=args.policy_replicas)
    return 0


def cmd_check(args) -> int:
    """`prorag check gpu`: every stage and service on the accelerator, with the figures (prorag_app.check_gpu)."""
    from prorag_app.check_gpu import run_check

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="prorag-check-gpu-"))
    try:
        result = run_check(work, quick=args.quick)
    finally:
        if not args.work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 0 if result["ok"] else 1


def cmd_diagnose(args) -> int:
    from prorag_app.diagnose import error_diagnosis, run_diagnosis  # per command (module docstring)

    run_dir = args.run or str(paths.runs_dir() / "latest")
    if args.target == "errors":
        report = error_diagnosis(run_dir, min_hops=args.min_hops, reference=args.reference)
        if args.json:
            print(json.dumps(report, sort_keys=True))
        return 0
    iterations = tuple(int(x) for x in args.iterations.split(",") if x.strip()) if args.iterations else ()
    report = run_diagnosis(run_dir, questions=args.questions,
                           samples=args.samples, iterations=iterations, port_offset=args.port_offset, seed=args.seed)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


def cmd_report(args) -> int:
    from prorag.runs import new_run_dir
    from prorag_app.report import build_report

    runs = args.runs or [str(paths.runs_dir() / "latest")]
    out = Path(args.out) if args.out else new_run_dir("report")
    report = build_report(runs, out, args.html)
    if args.json:
        print(json.dumps({k: report[k] for k in ("runs", "world", "seeds", "comparisons", "beta", "plots", "html")}))
    else:
        print((out / "report.md").read_text())
        print(f"report: {out / 'report.md'}")
        print(f"html report: {report['html']}")
    return 0


def cmd_compare(args) -> int:
    from prorag_app.report import cross_run_difference  # in the handler, as every command's (module docstring)

    r = cross_run_difference(args.a.split(","), args.b.split(","), args.method_a, args.method_b or args.method_a,
                             min_hops=args.min_hops)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    both = r["ci_seeds_questions"]
    print(f"{r['a']} ({len(r['runs_a'])} run(s)) - {r['b']} ({len(r['runs_b'])} run(s)), {r['group']}, "
          f"{r['n']} questions: {100 * r['f1_diff']:+.1f} F1 [{100 * r['ci'][0]:+.1f}, {100 * r['ci'][1]:+.1f}] "
          + (f"(seeds then questions resampled: [{100 * both[0]:+.1f}, {100 * both[1]:+.1f}]) " if both else "")
          + f"{100 * r['a_mean']:.1f} vs {100 * r['b_mean']:.1f}, "
          + f"wins/losses/ties {r['wins']}/{r['losses']}/{r['ties']}")
    return 0


def _add_health_parser(sub) -> None:
    h = sub.add_parser("health", help="check a service over the gRPC health protocol (exit 0 = SERVING); "
                                      "TLS and token from PRORAG_TLS_CA / PRORAG_TOKEN_FILE")
    h.add_argument("--target", default="", help="host:port (default: 127.0.0.1 and the service's documented port)")
    h.add_argument("--service-of", default="", choices=[""] + list(paths.SERVICES),
                   help="which service's documented port to use when --target is not given")
    h.add_argument("--service", default="", help="health service name ('' = the process, "
                                                 "prorag.v1.Policy = readiness of the policy)")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(fn=cmd_health)


def build_parser() -> argparse.ArgumentParser:
    from prorag.methods import METHODS
    from prorag_app.profiles import PROFILES

    p = argparse.ArgumentParser(prog="prorag", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    w = sub.add_parser("world", help="generate the embedded multi-hop benchmark")
    w.add_argument("--name", default="default")
    w.add_argument("--size", default=None, choices=["tiny", "small", "default", "large"],
                   help="default: the name when it is a size, else 'default'")
    w.add_argument("--seed", type=int, default=None, help="default: as the existing world was built, else 0")
    w.add_argument("--force", action="store_true", help="rebuild even if complete")
    w.set_defaults(fn=cmd_world)

    i = sub.add_parser("index", help="build dense (FAISS) and BM25 indexes; resumes after interruption")
    i.add_argument("--world", default="default", help="embedded world whose corpus is indexed")
    i.add_argument("--corpus", default=None, help="any wiki-18 style corpus.jsonl instead of the world's")
    i.add_argument("--out", default=None, help="index root (default: data/indexes/<world>)")
    i.add_argument("--faiss", default="flat", choices=["flat", "hnsw", "ivfpq"])
    i.add_argument("--encoder", default="minilm", help="'minilm' (shipped) or a local HF encoder path (e5, bge)")
    i.add_argument("--pooling", default="mean", choices=["mean", "cls"])
    i.add_argument("--query-prefix", default="", help="e.g. 'query: ' for e5")
    i.add_argument("--doc-prefix", default="", help="e.g. 'passage: ' for e5")
    i.add_argument("--fp16", action="store_true", help="encode in half precision on a GPU (ignored on a CPU)")
    i.set_defaults(fn=cmd_index)

    st = sub.add_parser("setup", help="the containers' one-shot setup: world, models, the corpus imported into the "
                                      "data volume and indexed; nothing when all is present (docs/DEPLOY.md)")
    st.add_argument("mode", choices=["cpu", "gpu"])
    st.set_defaults(fn=cmd_setup)

    pm = sub.add_parser("prepare-model", help="a stock causal LM with the step format's tags as tokens, so vLLM can "
                                              "serve it before SFT (weights linked unchanged when the embeddings "
                                              "have spare rows)")
    pm.add_argument("src", help="the model directory (e.g. .../models/hub/Qwen3-8B)")
    pm.add_argument("out", help="where the prepared model goes (e.g. .../models/hub/Qwen3-8B-prorag)")
    pm.set_defaults(fn=cmd_prepare_model)

    jb = sub.add_parser("job", help="start or follow a trainer job (prints the job as JSON)")
    jb_sub = jb.add_subparsers(dest="job_cmd", required=True)
    js = jb_sub.add_parser("start", help="submit STAGE with a JSON job config")
    js.add_argument("stage", help="sft, mcts, prm, rft, rl, dpo, ...")
    js.add_argument("config", help="the job config (JSON file, e.g. configs/paper/sft.json; '-' = stdin)")
    js.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one field (JSON or text), e.g. base_model=sft@<job id>")
    js.add_argument("--job-id", default="", help="a job id of your own (resubmitting it returns the same job)")
    jg = jb_sub.add_parser("get", help="one job's state")
    jg.add_argument("job_id")
    for sp in (js, jg):
        sp.add_argument("--trainer", default=f"127.0.0.1:{paths.GRPC_PORTS['trainer']}",
                        help="the trainer's address (TLS and token from PRORAG_TLS_CA / PRORAG_TOKEN_FILE)")
        sp.add_argument("--wait", action="store_true", help="follow the job to its end; exit 1 unless it succeeded")
        sp.add_argument("--timeout", type=float, default=0, help="seconds --wait waits at most (0 = no limit)")
    jb.set_defaults(fn=cmd_job)

    da = sub.add_parser("data", help="datasets in: `data import` writes MuSiQue, 2WikiMultiHopQA or HotpotQA as "
                                     "questions whose hops name corpus passages (SFT's decompositions)")
    da_sub = da.add_subparsers(dest="data_cmd", required=True)
    di = da_sub.add_parser("import", help="one dataset file into the question format, each hop's supporting paragraph "
                                          "aligned to a corpus passage (title, then BM25 text); prints the alignment "
                                          "rate and writes a report beside the output")
    di.add_argument("dataset", choices=["musique", "2wiki", "hotpotqa"], help="the file's dataset")
    di.add_argument("file", help="its original JSON/JSONL or FlashRAG's JSONL (.gz allowed)")
    di.add_argument("--corpus", default=None, help="the corpus the retriever serves (wiki-18 JSONL); without "
                                                   "--index-root a BM25 index of it is built once")
    di.add_argument("--index-root", default=None, help="a `prorag index` root over the corpus (docstore/, bm25/), "
                                                       "e.g. the retriever's RETRIEVER_INDEX_ROOT; with --corpus, "
                                                       "the two are built there when missing")
    di.add_argument("--out", default=None, help="output JSONL (default data/imports/<dataset>-<file>.jsonl); the "
                                                "report goes beside it as .report.json")
    di.add_argument("--limit", type=int, default=0, help="read at most N records (0 = all)")
    di.add_argument("--teacher-url", default=None, help="OpenAI-compatible endpoint that writes a decomposition "
                                                        "where the dataset has none (HotpotQA); key: OPENAI_API_KEY")
    di.add_argument("--teacher-model", default="gpt-4o", help="the teacher's model")
    di.add_argument("--json", action="store_true", help="also print the report as one JSON line, last")
    di.set_defaults(fn=cmd_data)

    bp = sub.add_parser("base", help="build the embedded base policy of a world (resumes if interrupted); "
                                     "prints its directory")
    bp.add_argument("--world", default="default")
    bp.add_argument("--source", choices=("shipped", "build"), default="shipped",
                    help="shipped: install the base shipped with the code for this world when it is the one the "
                         "defaults build, else warm one up; build: always warm one up here (replaces an installed "
                         "shipped base)")
    bp.set_defaults(fn=cmd_base)

    s = sub.add_parser("serve", help="start one service")
    s.add_argument("service", choices=list(paths.SERVICES))
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=None, help="gRPC port (default: the documented one)")
    s.add_argument("--http-port", type=int, default=None, help="HTTP port (-1 = off)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics port (default: the documented one, skipped with a warning when taken; "
                        "0 = any free, -1 = off)")
    s.add_argument("--log-format", choices=("json", "text"), default="json",
                   help="log lines on stderr: one JSON object per line (default) or plain text")
    s.add_argument("--config", default=None, help="YAML file with the service's settings")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting")
    s.add_argument("--port-offset", type=int, default=0, help="shift of the ports of the other services it calls")
    s.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS (default $PRORAG_TLS_CERT)")
    s.add_argument("--tls-key", default="", help="PEM key of --tls-cert (default $PRORAG_TLS_KEY)")
    s.add_argument("--tls-client-ca", default="", help="require client certificates from this CA (mutual TLS; "
                                                       "default $PRORAG_TLS_CLIENT_CA)")
    s.add_argument("--auth-tokens", default="", help="YAML tokens file: require bearer tokens "
                                                     "(default $PRORAG_AUTH_TOKENS)")
    s.add_argument("--max-concurrent-rpcs", type=int, default=None, help="calls served at once (0 = no limit)")
    s.set_defaults(fn=cmd_serve)

    _add_health_parser(sub)

    sec = sub.add_parser("security", help="generate TLS material and tokens")
    sec_sub = sec.add_subparsers(dest="security_cmd", required=True)
    si = sec_sub.add_parser("init", help="write a private CA, server and client certificates, a tokens file (hashes "
                                         "only) and the tokens themselves (files 0600)")
    si.add_argument("--out", default="secrets", help="directory to write (keep it out of git)")
    si.add_argument("--host", action="append", default=[], help="name or IP the server certificate is valid for "
                                                                "(repeatable; default: localhost, 127.0.0.1 and "
                                                                "the compose and k8s service names)")
    si.add_argument("--days", type=int, default=365)
    si.set_defaults(fn=cmd_security_init)

    u = sub.add_parser("up", help="start all five services on the documented ports")
    u.add_argument("--port-offset", type=int, default=0)
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--world", default="default")
    u.add_argument("--size", default=None, choices=["tiny", "small", "default", "large"])
    u.add_argument("--start-timeout", type=float, default=180.0)
    u.add_argument("--model", default=None, help="policy model: a directory or a published name[@version] (default: "
                                                 "the newest agent `prorag run` trained for the world, else its base)")
    u.add_argument("--prm", default=None, help="PRM model: a published name@version (a bare name: its newest "
                                               "version) or a directory; 'none' starts the PRM service empty "
                                               "(default: the newest PRM published for the world, else empty)")
    u.set_defaults(fn=cmd_up)

    b = sub.add_parser("bench", help="benchmarks; --json prints one JSON object as the last line")
    b.add_argument("target", help="retriever | policy | swap | sft | prm | rl | load | soak")
    b.add_argument("--json", action="store_true")
    b.add_argument("--world", default="default")
    b.add_argument("--batch", type=int, default=64)
    b.add_argument("--iters", type=int, default=30)
    b.add_argument("--repeats", type=int, default=3, help="repeated runs; medians are reported")
    b.add_argument("--index", default="dense")
    b.add_argument("--model", default="sft", help="policy/swap: published model name[@version], a path, or 'base'")
    b.add_argument("--questions", type=int, default=64, help="policy: questions per rollout batch; rl: per iteration")
    b.add_argument("--samples", type=int, default=8, help="policy: samples per question (GRPO group size)")
    b.add_argument("--engines", default="auto", help="policy: comma-separated engines to compare (auto: transformers, "
                                                    "and the vLLM policies where `make vllm-env` built a vLLM Python)")
    b.add_argument("--swaps", type=int, default=100, help="swap: adapter pushes")
    b.add_argument("--clients", type=int, default=4, help="swap: concurrent generating clients; prm: concurrent "
                                                          "callers; soak: steady callers")
    b.add_argument("--seq-len", type=int, default=512, help="sft: tokens per training sequence")
    b.add_argument("--device", default="auto", help="sft: auto (the first GPU, else cpu), cpu, cuda, cuda:N")
    b.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="sft: compute dtype under autocast (auto = bf16 on a GPU, float32 on the CPU)")
    b.add_argument("--compile", action="store_true", help="sft: torch.compile each decoder block")
    b.add_argument("--fused-ce", action="store_true",
                   help="sft: the LM head and cross-entropy through liger-kernel's fused kernel (CUDA only)")
    b.add_argument("--reference-url", default="",
                   help="retriever: a Search-R1-compatible server (http://127.0.0.1:PORT/retrieve) measured at the "
                        "same load shapes; ratios ours / reference are reported")
    b.add_argument("--shape-requests", type=int, default=200,
                   help="retriever: requests of the one-client one-query shape (the other shapes scale from it)")
    b.add_argument("--no-secure", action="store_true",
                   help="retriever: skip the TLS + bearer-token server in the load shapes")
    # load / soak (prorag_app.bench.load): services started by the bench on free loopback ports
    b.add_argument("--services", default="retriever,policy,prm", help="load: services driven, comma-separated")
    b.add_argument("--levels", default="", help="load: concurrency levels, e.g. 1,2,4 (default: 1, 2, 4, ... up to "
                                                "--max-concurrency)")
    b.add_argument("--max-concurrency", type=int, default=32, help="load: the highest level (at most 256)")
    b.add_argument("--level-seconds", type=float, default=10.0, help="load: seconds of calls per level")
    b.add_argument("--deadline-s", type=float, default=30.0, help="load/soak: the deadline of every call")
    b.add_argument("--overload-rpcs", type=int, default=2,
                   help="load: the server's --max-concurrent-rpcs (and the retriever's batcher queue) past capacity")
    b.add_argument("--overload-clients", type=int, default=0,
                   help="load: callers past capacity (default 4 x --overload-rpcs)")
    b.add_argument("--overload-seconds", type=float, default=10.0, help="load: seconds of the past-capacity phase")
    b.add_argument("--load-tokens", type=int, default=16, help="load/soak: tokens per policy GenerateSteps call")
    b.add_argument("--warmup", type=int, default=3, help="load/soak: calls made before measuring")
    b.add_argument("--service", default="retriever", choices=["retriever", "policy", "prm"],
                   help="soak: the service under steady load")
    b.add_argument("--minutes", type=float, default=10.0, help="soak: minutes of steady load")
    b.add_argument("--sample-s", type=float, default=5.0, help="soak: seconds between RSS samples")
    b.add_argument("--flat-mb-per-min", type=float, default=2.0,
                   help="soak: RSS counts as flat when its second-half slope is under this (MB/minute)")
    b.set_defaults(fn=cmd_bench)

    e = sub.add_parser("eval", help="evaluate a policy model over a split through the services, or (eval prm) a "
                                    "process reward model on gold against corrupted steps")
    e.add_argument("target", nargs="?", default="policy", choices=["policy", "prm"],
                   help="policy (default) or prm")
    e.add_argument("--profile", default="default", choices=list(PROFILES),
                   help="prm: the profile whose agent format the gold steps are written in")
    e.add_argument("--seed", type=int, default=0, help="prm: seed of the corruptions")
    e.add_argument("--reference-policy", default="",
                   help="prm: also score the same cases by this policy's own log-likelihood of each step (published "
                        "model name[@version] or a path), the reference the PRM is read against")
    e.add_argument("--method", default="sft", help=f"a method of the table ({', '.join(METHODS)}) or another "
                                                   "name, evaluated as an agent (step-by-step rollouts)")
    e.add_argument("--model", default=None, help="published model name[@version] or a path (default: --method; "
                                                 "prm: the newest published PRM)")
    e.add_argument("--world", default="default")
    e.add_argument("--split", default="test", choices=["train", "dev", "test"])
    e.add_argument("--limit", type=int, default=0, help="first N questions only")
    e.add_argument("--topk", type=int, default=0,
                   help="documents per search (default: what the model was trained with, else 3)")
    e.add_argument("--retriever", default=None, help="retriever host:port (default: start one)")
    e.add_argument("--port-offset", type=int, default=200)
    e.add_argument("--out", default=None, help="directory for predictions (default: a new run dir)")
    e.set_defaults(fn=cmd_eval)

    r = sub.add_parser("run", help="the main job on the embedded default; writes runs/latest/results.json")
    r.add_argument("--profile", default="default", choices=[*PROFILES, "ablation"],
                   help="ablation: the default profile over 3 stage 3-4 seeds, without RFT, at 4 more betas, then "
                        "`prorag report` over them (hours on 2 cores; every finished job reused); research: issue "
                        "30's experiment over 3 stage 3-4 seeds, then the report (a single seed with "
                        "--stage34-seed; hours)")
    r.add_argument("--world", default=None)
    r.add_argument("--port-offset", type=int, default=0)
    r.add_argument("--policy-replicas", type=int, default=0,
                   help="processes of the policy that stages 2-4 sample from, balanced round-robin, each on its "
                        "share of the cores (0 = one per core up to 4 on a CPU host, 1 with a GPU); changes how "
                        "fast, not what: jobs and their samples are the same")
    r.add_argument("--stage34-seed", type=int, default=None,
                   help="seed of the RFT, RL and DPO jobs (default: the profile's); another seed trains them anew")
    r.add_argument("--beta", type=float, default=None, help="ProRAG's process-advantage weight (default: the "
                                                            "profile's, 0.3)")
    r.add_argument("--split", default="test", choices=("test", "dev"),
                   help="where methods are evaluated and compared: test for the figures, dev for choosing settings "
                        "(with the dev deep split, disjoint from the test one)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one profile setting, a dotted path with a JSON value, e.g. "
                        "--set stage34.rft.lr=1e-4 --set 'stage34.methods=[\"rft\"]' (repeatable)")
    r.set_defaults(fn=cmd_run)

    ck = sub.add_parser("check", help="gpu: train, serve, roll out and score on the accelerator (the CPU when there is "
                                      "none, said in the output) and print the throughput figures; at most ~5 min")
    ck.add_argument("target", choices=["gpu"])
    ck.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ck.add_argument("--work", default="", help="workspace (world, models, logs); default: a temporary directory, "
                                              "removed afterwards")
    ck.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    ck.add_argument("--quick", action="store_true", help="fewer steps (the CPU test's setting)")
    ck.set_defaults(fn=cmd_check)

    dg = sub.add_parser("diagnose", help="rl: does a run's RL sharpen, memorise or drift? Its SFT agent and RL "
                                         "adapters on pool and unseen dev deep questions, greedy and sampled, with "
                                         "entropy and wins/losses by solve rate; writes RUN/diagnosis.json. "
                                         "errors: why the run's answers are wrong, read along each question's gold "
                                         "chain from the recorded trajectories, and which errors each model fixed "
                                         "or made against SFT (no model runs); writes RUN/errors.json")
    dg.add_argument("target", choices=["rl", "errors"])
    dg.add_argument("run", nargs="?", default=None, help="a `prorag run` directory (default: runs/latest)")
    dg.add_argument("--questions", type=int, default=300, help="questions per set (pool, unseen)")
    dg.add_argument("--samples", type=int, default=4, help="samples per question at temperature 1 (at least 2)")
    dg.add_argument("--iterations", default="", help="RL iterations whose adapters are read too, e.g. 15,30")
    dg.add_argument("--seed", type=int, default=0, help="the question draw and the sampling seed")
    dg.add_argument("--port-offset", type=int, default=400)
    dg.add_argument("--min-hops", type=int, default=3, help="errors: questions of at least this many hops")
    dg.add_argument("--reference", default="sft", help="errors: the model the others' fixes and new errors are "
                                                       "counted against")
    dg.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    dg.set_defaults(fn=cmd_diagnose)

    rep = sub.add_parser("report", help="one report (Markdown, JSON, PNG, HTML) over `prorag run` directories of the "
                                        "same world: their seeds pooled, paired comparisons, RL curves, beta")
    rep.add_argument("runs", nargs="*", help="run directories (default: runs/latest)")
    rep.add_argument("--out", default=None, help="output directory (default: a new runs/<time>-report)")
    rep.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    rep.add_argument("--html", default=None, help="folder of the HTML report, index.html (default: the first run's "
                                                  "report/, e.g. runs/latest/report); opens from disk, no server")
    rep.set_defaults(fn=cmd_report)

    cmp_ = sub.add_parser("compare", help="one method of some `prorag run` directories against a method of others, "
                                          "paired per question (what a dev choice reads: a setting's runs against "
                                          "another's, seed by seed)")
    cmp_.add_argument("a", help="run directories of side A, comma-separated (the i-th is paired with B's i-th)")
    cmp_.add_argument("b", help="run directories of side B, as many as A")
    cmp_.add_argument("--method-a", default="outcome_grpo", help="A's method (default: outcome_grpo)")
    cmp_.add_argument("--method-b", default="", help="B's method (default: A's)")
    cmp_.add_argument("--min-hops", type=int, default=3, help="only questions of at least this many hops (default 3, "
                                                               "as the runs' comparisons)")
    cmp_.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmp_.set_defaults(fn=cmd_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # called in-process (tests, tools): the caller's signal handling stays as it is
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:
        # Probes run this every few seconds: skip the full parser, whose choices import the pipeline and torch.
        light = argparse.ArgumentParser(prog="prorag")
        _add_health_parser(light.add_subparsers(dest="cmd", required=True))
        health_args = light.parse_args(argv)
        return health_args.fn(health_args)
    args = build_parser().parse_args(argv)
    from prorag_app import procs

    if as_program and args.fn is not cmd_serve and threading.current_thread() is threading.main_thread():
        # SIGTERM (a timeout, docker stop) and Ctrl-C stop every process this command started: see prorag_app.procs
        procs.install_signal_handlers()
    try:
        return args.fn(args)
    except procs.Stopped as e:
        print(f"prorag: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ProragError as e:  # a caller's mistake (unknown model, bad argument): say it, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        # a service failed a call the command depends on (a deadline passed, the service went away): not the
        # caller's mistake, and nothing finished is lost (jobs and evaluations are kept and reused), so say which
        # status and how to go on rather than print grpc's traceback
        code = e.code().name if hasattr(e, "code") and e.code() is not None else "UNKNOWN"
        details = e.details() if hasattr(e, "details") else str(e)
        print(f"error: a service call failed with {code}: {details}. Finished jobs and evaluations are kept: run the "
              "same command again to continue from them (`prorag health` says which services answer).",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
