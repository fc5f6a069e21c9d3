"""The judge's openai backend against an OpenAI-compatible endpoint that fails in every way, served for real on
loopback (http.server in a thread, scripted per request): timeouts, refused and dropped connections, 429 with
Retry-After, 500, bodies that are no chat completion, replies without a usable choice. Each is retried and counted,
or fails with its reason; a bad reply never becomes a label; a restarted judge on the same cache makes no call."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prorag.errors import DeadlineExceeded, ProragError, Unavailable
from prorag.trajectory import Step
from services.judge.engine import Budget, JudgeCache, OpenAIJudge, PairRequest

GOOD = Step("subquery", thought="First her employer.", content="Who employs Ana Lind?")
BAD = Step("subquery", thought="Guess.", content="Who founded Ana Lind?")
CHOSE_1 = '{"chosen": 1, "reason": "step 1 names the right entity"}'


def completion(content: str) -> bytes:
    return json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "judge-model",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}],
                       "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}).encode()


class FaultyEndpoint:
    """/v1/chat/completions answering each request with the next scripted behaviour (then ``after``):
    ("ok", content) | ("status", code, headers) | ("sleep", seconds) | ("body", bytes, content_type) | ("drop",)."""

    def __init__(self):
        self.script: list[tuple] = []
        self.after: tuple = ("ok", CHOSE_1)
        self.times: list[float] = []  # when each request arrived
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner.lock:
                    owner.times.append(time.monotonic())
                    act = owner.script.pop(0) if owner.script else owner.after
                if act[0] == "drop":  # the connection closes with no status line
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if act[0] == "sleep":
                    time.sleep(act[1])
                    act = ("ok", CHOSE_1)
                if act[0] == "ok":
                    self._send(200, completion(act[1]), "application/json")
                elif act[0] == "status":
                    self._send(act[1], json.dumps({"error": {"message": f"scripted {act[1]}"}}).encode(),
                               "application/json", act[2] if len(act) > 2 else {})
                elif act[0] == "body":
                    self._send(200, act[1], act[2])

            def _send(self, code, body, ctype, headers=None):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def requests(self) -> int:
        with self.lock:
            return len(self.times)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    ep = FaultyEndpoint()
    yield ep
    ep.close()


def make_judge(url, cache_path, **kw) -> OpenAIJudge:
    opts = {"timeout_s": 5.0, "max_retries": 3, "malformed_retries": 1, "backoff_s": 0.05, "max_backoff_s": 0.2,
            "concurrency": 1, **kw}
    return OpenAIJudge(url, "judge-model", JudgeCache(cache_path), Budget(), **opts)


def pair(id="p1", a=GOOD, b=BAD) -> PairRequest:
    return PairRequest(id, "", "Who founded the employer of Ana Lind?", [], [a, b])


def test_500_then_a_good_reply_is_retried_counted_and_labelled(endpoint, tmp_path):
    endpoint.script = [("status", 500), ("status", 503)]
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl")
    [v] = judge.judge([pair()])
    assert (v.chosen, v.rejected, v.cached) == (0, 1, False)
    assert endpoint.requests == 3
    c = judge.info()["counters"]
    assert (c["requests"], c["retries"], c["errors.http_500"], c["errors.http_503"], c["labelled"]) == (3, 2, 1, 1, 1)
    assert "failed" not in c


def test_429_waits_for_retry_after_and_a_too_long_one_fails_at_once(endpoint, tmp_path):
    endpoint.script = [("status", 429, {"Retry-After": "1"})]
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", max_retry_after_s=5)
    [v] = judge.judge([pair()])
    assert v.chosen == 0 and endpoint.requests == 2
    assert endpoint.times[1] - endpoint.times[0] >= 0.9  # the endpoint's wait, not our 0.05 s backoff
    assert judge.info()["counters"]["errors.http_429"] == 1
    # a wait beyond max_retry_after_s is not sat through: UNAVAILABLE at once, saying why, and nothing cached
    endpoint.script = [("status", 429, {"Retry-After": "3600"})]
    with pytest.raises(Unavailable) as e:
        judge.judge([pair("p2", BAD, GOOD)])
    assert "429" in str(e.value) and "3600" in str(e.value) and endpoint.requests == 3
    assert judge.info()["counters"]["failed"] == 1 and len(judge.cache) == 1
    # Retry-After-Ms is read too
    endpoint.script = [("status", 503, {"Retry-After-Ms": "300"})]
    judge.judge([pair("p3", BAD, GOOD)])
    assert endpoint.requests == 5 and endpoint.times[4] - endpoint.times[3] >= 0.25


def test_persistent_5xx_fails_with_the_reason_after_every_retry(endpoint, tmp_path):
    endpoint.after = ("status", 500)
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", max_retries=2)
    with pytest.raises(Unavailable) as e:
        judge.judge([pair()])
    assert "HTTP 500" in str(e.value) and "after 3 attempt(s)" in str(e.value)
    assert endpoint.requests == 3 and len(judge.cache) == 0
    c = judge.info()["counters"]
    assert (c["requests"], c["retries"], c["errors.http_500"], c["failed"]) == (3, 2, 3, 1)


def test_timeouts_are_retried_then_deadline_exceeded(endpoint, tmp_path):
    endpoint.script = [("sleep", 2.0)]  # one slow reply, then a good one
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", timeout_s=0.5)
    assert judge.judge([pair()])[0].chosen == 0
    assert endpoint.requests == 2 and judge.info()["counters"]["errors.timeout"] == 1
    endpoint.after = ("sleep", 2.0)
    judge = make_judge(endpoint.url, tmp_path / "c2.jsonl", timeout_s=0.5, max_retries=1)
    with pytest.raises(DeadlineExceeded) as e:
        judge.judge([pair()])
    assert "timed out" in str(e.value) and judge.info()["counters"]["errors.timeout"] == 2
    assert len(judge.cache) == 0


def test_refused_and_dropped_connections_are_retried_then_unavailable(endpoint, tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = make_judge(f"http://127.0.0.1:{port}/v1", tmp_path / "c.jsonl", max_retries=2)
    with pytest.raises(Unavailable) as e:
        judge.judge([pair()])
    assert "unreachable" in str(e.value)
    c = judge.info()["counters"]
    assert (c["errors.connection"], c["retries"], c["failed"]) == (3, 2, 1)
    endpoint.script = [("drop",)]
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl")
    assert judge.judge([pair()])[0].chosen == 0
    assert endpoint.requests == 2 and judge.info()["counters"]["errors.connection"] == 1


@pytest.mark.parametrize("body,ctype", [(b'{"choices": [{"message": {"content": "{\\"chosen\\": 1', "application/json"),
                                        (b"<html>bad gateway</html>", "text/html"),
                                        (b'{"id": "x", "choices": []}', "application/json"),
                                        (b"[1, 2, 3]", "application/json")])
def test_bodies_that_are_no_chat_completion_are_retried_never_labelled(endpoint, tmp_path, body, ctype):
    endpoint.after = ("body", body, ctype)
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", max_retries=2)
    with pytest.raises(Unavailable) as e:
        judge.judge([pair()])
    assert not isinstance(e.value, DeadlineExceeded) and "reply" in str(e.value)
    assert endpoint.requests == 3 and judge.info()["counters"]["errors.bad_response"] == 3
    assert len(judge.cache) == 0
    endpoint.script, endpoint.after = [("body", body, ctype)], ("ok", CHOSE_1)  # once, then a good reply
    assert judge.judge([pair()])[0].chosen == 0


@pytest.mark.parametrize("reply", ['{"chosen": 3, "reason": "the third"}', '{"chosen": 0}', '{"chosen": -1}',
                                   '{"chosen": true}', '{"chosen": "first"}', '{"reason": "no choice"}',
                                   "Step 1 is better.", '{"chosen": 1, "reason": "cut off'])
def test_a_reply_without_a_usable_choice_is_asked_again_and_never_labelled(endpoint, tmp_path, reply):
    endpoint.after = ("ok", reply)
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", malformed_retries=2)
    with pytest.raises(Unavailable) as e:
        judge.judge([pair()])
    assert "no usable choice" in str(e.value) and endpoint.requests == 3
    c = judge.info()["counters"]
    assert (c["malformed_replies"], c["failed"]) == (3, 1) and "labelled" not in c
    assert len(judge.cache) == 0
    endpoint.script, endpoint.after = [("ok", reply)], ("ok", '{"chosen": 2, "reason": "the second"}')
    [v] = judge.judge([pair()])
    assert (v.chosen, v.rejected) == (1, 0) and endpoint.requests == 5


def test_a_restarted_judge_serves_answered_pairs_from_its_cache_without_a_call(endpoint, tmp_path):
    cache = tmp_path / "cache.jsonl"
    endpoint.script = [("status", 500)]
    judge = make_judge(endpoint.url, cache)
    first = judge.judge([pair("a"), pair("b", BAD, GOOD)])
    assert [(v.chosen, v.cached) for v in first] == [(0, False), (0, False)] and endpoint.requests == 3
    # a killed process's torn last line: skipped on reading, and the next row still lands on a line of its own
    with open(cache, "a", encoding="utf-8") as f:
        f.write('{"key": "torn", "chos')
    judge = make_judge(endpoint.url, cache)
    endpoint.after = ("ok", '{"chosen": null, "reason": "no clear winner"}')
    assert judge.judge([pair("c", GOOD, GOOD)])[0].chosen == -1 and endpoint.requests == 4
    endpoint.after = ("status", 500)  # any further call would fail the test
    restarted = make_judge(endpoint.url, cache, max_retries=0)
    again = restarted.judge([pair("a2"), pair("b2", BAD, GOOD), pair("c2", GOOD, GOOD)])
    assert [(v.id, v.chosen, v.cached) for v in again] == [("a2", 0, True), ("b2", 0, True), ("c2", -1, True)]
    assert endpoint.requests == 4
    assert restarted.info()["counters"] == {"cache_hits": 3} and restarted.info()["calls_made"] == 0


def test_failures_are_proragerrors_with_a_grpc_status(endpoint, tmp_path):
    """Every failure above reaches the caller as a status it can act on, not INTERNAL."""
    endpoint.after = ("body", b"nonsense", "text/plain")
    judge = make_judge(endpoint.url, tmp_path / "c.jsonl", max_retries=0)
    with pytest.raises(ProragError) as e:
        judge.judge([pair()])
    assert e.value.code.name == "UNAVAILABLE"


def test_the_service_config_sets_the_backoff_and_the_longest_retry_after(endpoint, tmp_path):
    from services.judge.server import JudgeConfig, open_engine

    cfg = JudgeConfig(backend="openai", base_url=endpoint.url, model="judge-model",
                      cache_path=str(tmp_path / "c.jsonl"), max_retries=2, backoff_s=0.3, max_backoff_s=0.3,
                      max_retry_after_s=2.0, concurrency=1)
    judge = open_engine(cfg)
    # a Retry-After of 3 s is more than this config honours: failed at once, where the default (30 s) would wait
    endpoint.script = [("status", 429, {"Retry-After": "3"})]
    with pytest.raises(Unavailable) as e:
        judge.judge([pair()])
    assert "max_retry_after_s=2" in str(e.value) and endpoint.requests == 1
    # with no Retry-After, the configured backoff: 0.3 s jittered down by at most a quarter
    endpoint.script = [("status", 500)]
    [v] = judge.judge([pair("p2")])
    assert v.chosen == 0 and endpoint.requests == 3
    assert 0.2 <= endpoint.times[2] - endpoint.times[1] < 2.0
