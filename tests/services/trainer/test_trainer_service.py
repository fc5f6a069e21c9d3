"""The Trainer over real gRPC on port 0: start, watch, cancel, get, list, and the error statuses."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorag.rpc.clients_trainer import TrainerClient, state_name
from tests.helpers import LoopThread, free_port
from prorag.pb import trainer_pb2, trainer_pb2_grpc
from prorag.rpc.service import ServeConfig
from services.trainer.server import SERVICE, TrainerConfig, start

FAST = {"steps": 40, "checkpoint_every": 10, "log_every": 5, "tracking": "local"}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    loop = LoopThread()
    root = tmp_path_factory.mktemp("trainer") / "jobs"
    started = loop.run(start(ServeConfig(port=0, grace_s=1), TrainerConfig(jobs_root=str(root), tracking="local")))
    target = f"127.0.0.1:{started.grpc_port}"
    client = TrainerClient(target, timeout=10)
    yield target, client, root
    client.close()
    loop.run(started.stop())
    loop.close()


def _code(call, *args, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        call(*args, **kw)
    return ei.value.code(), ei.value.details()


def test_ready_once_store_is_loaded(trainer):
    target, _, _ = trainer
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_start_watch_to_completion_get_and_list(trainer):
    _, tc, root = trainer
    job = tc.start("selftest", FAST, job_id="svc-1")
    assert job.job_id == "svc-1" and state_name(job.state) in ("QUEUED", "RUNNING")
    assert tc.config_of(job)["steps"] == 40
    events = list(tc.watch("svc-1", timeout=60))
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] == 1
    assert state_name(events[0].state) == "QUEUED" and state_name(events[-1].state) == "SUCCEEDED"
    progress = [e for e in events if e.loss]
    assert [e.step for e in progress] == list(range(5, 41, 5))
    assert all(e.total_steps == 40 for e in progress) and progress[-1].eta_s == 0.0
    assert any(e.eta_s > 0 for e in progress[1:-1]) and all(e.tokens_per_s > 0 for e in progress)
    final = events[-1]
    assert [a.name for a in final.artifacts] == ["weights"] and final.metrics["final_loss"] > 0

    got = tc.get("svc-1")
    assert state_name(got.state) == "SUCCEEDED" and got.step == 40 and got.total_steps == 40
    assert got.run_dir == str((root / "svc-1" / "run").resolve())
    assert got.artifacts[0].path == str((root / "svc-1" / "run" / "weights.pt").resolve())
    assert "svc-1" in [j.job_id for j in tc.list()] and "svc-1" in [j.job_id for j in tc.list("selftest")]
    assert tc.list("rl") == []

    # A watch resumes after a given seq and ends at once for a finished job.
    tail = list(tc.watch("svc-1", after_seq=seqs[-3], timeout=10))
    assert [e.seq for e in tail] == seqs[-2:]
    assert list(tc.watch("svc-1", after_seq=seqs[-1], timeout=10)) == []
    assert state_name(tc.wait("svc-1", timeout=10).state) == "SUCCEEDED"


def test_idempotent_start_and_conflict(trainer):
    _, tc, _ = trainer
    a = tc.start("selftest", FAST, job_id="svc-idem")
    b = tc.start("selftest", FAST, job_id="svc-idem")
    assert a.created_at == b.created_at
    code, details = _code(tc.start, "selftest", {**FAST, "lr": 0.01}, job_id="svc-idem")
    assert code == grpc.StatusCode.ALREADY_EXISTS and "svc-idem" in details
    tc.wait("svc-idem", timeout=60)


def test_cancel_a_running_job(trainer):
    _, tc, _ = trainer
    tc.start("selftest", {**FAST, "steps": 100_000, "step_sleep_s": 0.01}, job_id="svc-cancel")
    for ev in tc.watch("svc-cancel", timeout=60):
        if ev.step >= 10:
            break
    tc.cancel("svc-cancel")
    job = tc.wait("svc-cancel", timeout=30)
    assert state_name(job.state) == "CANCELLED" and job.step < 100_000
    code, details = _code(tc.cancel, "svc-cancel")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already CANCELLED" in details


def test_errors_map_to_statuses(trainer, tmp_path):
    _, tc, root = trainer
    cases = [
        ((tc.start, "selftest", "{oops"), grpc.StatusCode.INVALID_ARGUMENT, "not valid JSON"),
        ((tc.start, "selftest", {"lr": 5}), grpc.StatusCode.INVALID_ARGUMENT, "config.lr: must be <= 1.0"),
        ((tc.start, "selftest", {"nope": 1}), grpc.StatusCode.INVALID_ARGUMENT, "config.nope"),
        ((tc.start, "sft2000", {}), grpc.StatusCode.INVALID_ARGUMENT, "known stages"),
        ((tc.start, "selftest", {"init_from": str(root / "not-a-run")}), grpc.StatusCode.FAILED_PRECONDITION,
         "input 'init_from'"),
        ((tc.get, "ghost"), grpc.StatusCode.NOT_FOUND, "ghost"),
        ((tc.cancel, "ghost"), grpc.StatusCode.NOT_FOUND, "ghost"),
    ]
    for (fn, *args), code, fragment in cases:
        got, details = _code(fn, *args)
        assert got == code, (args, details)
        assert fragment in details
    got, details = _code(lambda: list(tc.watch("ghost", timeout=5)))
    assert got == grpc.StatusCode.NOT_FOUND


def test_watch_honours_the_call_deadline(trainer):
    target, tc, _ = trainer
    tc.start("selftest", {**FAST, "steps": 100_000, "step_sleep_s": 0.01}, job_id="svc-deadline")
    with grpc.insecure_channel(target) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            for _ in stub.WatchJob(trainer_pb2.WatchJobRequest(job_id="svc-deadline"), timeout=1.0):
                pass
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError):
        list(tc.watch("svc-deadline", timeout=0.5))
    tc.cancel("svc-deadline")
    assert state_name(tc.wait("svc-deadline", timeout=30).state) == "CANCELLED"


def _sft(root, **kw):
    # a config that passes every check (the jobs root stands in for a model directory inside the data root)
    return {"world": "tiny", "base_model": str(root), "retriever": "127.0.0.1:50051", "tracking": "local", **kw}


@pytest.mark.parametrize("change, fragment", [
    ({"world": "../worlds/tiny"}, "config.world '../worlds/tiny': must be a plain name"),
    ({"world": "a/b"}, "config.world"),
    ({"publish_name": ".."}, "config.publish_name"),
    ({"base_model": "/etc"}, "config.base_model '/etc' resolves to /etc, outside the data root"),
    ({"base_model": "{root}/../../.."}, "outside the data root"),
    ({"questions": "/etc/passwd"}, "config.questions"),
    ({"thoughts": "openai", "openai_base_url": "https://evil.example"},
     "config.openai_base_url 'https://evil.example': evil.example:443 is not on this trainer's allowed endpoints"),
    ({"thoughts": "openai", "openai_base_url": "file:///etc/passwd"}, "not an http(s) URL"),
    ({"retriever": "evil.example:50051"}, "config.retriever"),
    ({"retriever": "ipv4:127.0.0.1:50051,10.1.2.3:50051"}, "10.1.2.3:50051"),
    ({"retriever": "dns://8.8.8.8/retriever:50051"}, "8.8.8.8"),  # the DNS server it would ask is dialled too
    ({"retriever": "unix:/var/run/docker.sock"}, "target scheme"),
])
def test_a_job_naming_a_path_outside_the_data_root_or_an_unlisted_endpoint_is_refused(trainer, change, fragment):
    _, tc, root = trainer
    change = {k: v.replace("{root}", str(root)) for k, v in change.items()}
    got, details = _code(tc.start, "sft", _sft(root, **change), job_id="refused")
    assert got == grpc.StatusCode.INVALID_ARGUMENT, details
    assert fragment in details, details
    assert "refused" not in {j.job_id for j in tc.list()}  # nothing was queued, let alone run


def test_a_job_on_allowed_endpoints_inside_the_data_root_still_starts(trainer):
    _, tc, root = trainer
    config = _sft(root, retriever="dns:///localhost:50051", thoughts="openai",
                  openai_base_url="http://127.0.0.1:8001/v1", publish_name="sft.v2")
    job = tc.start("sft", config, job_id="accepted")
    assert job.job_id == "accepted" and state_name(job.state) in ("QUEUED", "RUNNING")
    try:
        tc.cancel("accepted")  # its base model is not a model: it would only fail
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION  # it failed already
    assert state_name(tc.wait("accepted", timeout=60).state) in ("CANCELLED", "FAILED")


def test_a_waiting_client_reaches_a_trainer_that_comes_up_late_and_a_plain_one_fails_fast(tmp_path):
    """The pipeline's client waits (within its deadline) for a trainer it cannot reach yet rather than stopping the
    whole run on one UNAVAILABLE; a plain client still says UNAVAILABLE at once."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    with TrainerClient(target, timeout=5) as plain:
        t0 = time.monotonic()
        assert _code(plain.list)[0] == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 4
    loop, box = LoopThread(), []
    later = threading.Timer(1.5, lambda: box.append(loop.run(start(
        ServeConfig(port=port, grace_s=1), TrainerConfig(jobs_root=str(tmp_path / "jobs"), tracking="local")))))
    later.start()
    try:
        with TrainerClient(target, timeout=30, wait_for_ready=True) as waiting:
            assert waiting.list() == []
            job = waiting.start("selftest", FAST, job_id="late-1")
            assert waiting.get(job.job_id).job_id == "late-1"
    finally:
        later.join()
        loop.run(box[0].stop())
        loop.close()
