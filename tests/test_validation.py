"""prorag.validation: plain names, paths inside the data root, endpoints on an allowlist."""

from __future__ import annotations

import pytest

from prorag import validation as v
from prorag.errors import InvalidArgument

ALLOWED = v.DEFAULT_ALLOWED_ENDPOINTS


@pytest.mark.parametrize("name", ["tiny", "default", "sft.v2", "a_b-c", "A" * 128, "v1"])
def test_plain_names_pass(name):
    assert v.check_name("config.world", name) == name


@pytest.mark.parametrize("name", ["", "..", "../worlds/tiny", "a/b", "/abs", ".hidden", "-x", "a..b", "a b",
                                  "A" * 129, "tiny\x00", "a\\b"])
def test_names_that_could_leave_their_directory_are_refused_naming_the_field(name):
    with pytest.raises(InvalidArgument, match=r"config\.world .*plain name"):
        v.check_name("config.world", name)


def test_paths_must_resolve_inside_a_root(tmp_path):
    root = tmp_path / "home"
    (root / "data" / "m").mkdir(parents=True)
    assert v.check_path("config.base_model", str(root / "data" / "m"), [root]) == (root / "data" / "m").resolve()
    assert v.check_path("config.output", str(root / "new" / "dir"), [root])  # need not exist yet
    for bad in ("/etc/passwd", str(root / ".." / "x"), str(root / "data" / ".." / ".." / "x"), str(tmp_path)):
        with pytest.raises(InvalidArgument, match=r"config\.base_model .*outside the data root"):
            v.check_path("config.base_model", bad, [root])
    # a symlink inside the root that points out of it is judged by where it leads
    (root / "data" / "link").symlink_to("/etc")
    with pytest.raises(InvalidArgument, match="resolves to /etc"):
        v.check_path("config.questions", str(root / "data" / "link" / "passwd"), [root])
    # a sibling whose name merely starts like the root is not inside it
    (tmp_path / "home2").mkdir()
    with pytest.raises(InvalidArgument):
        v.check_path("config.questions", str(tmp_path / "home2"), [root])


def test_relative_paths_resolve_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert v.check_path("f", "data/x.jsonl", [tmp_path]) == tmp_path / "data" / "x.jsonl"
    with pytest.raises(InvalidArgument):
        v.check_path("f", "../x.jsonl", [tmp_path])


def test_data_roots_follow_prorag_home_data_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "d"))
    monkeypatch.delenv("PRORAG_RUNS", raising=False)
    assert v.data_roots([tmp_path / "jobs"]) == [tmp_path / "h", tmp_path / "d", tmp_path / "h" / "runs",
                                                 tmp_path / "jobs"]


@pytest.mark.parametrize("target, expect", [
    ("127.0.0.1:50051", [("127.0.0.1", 50051)]),
    ("localhost:50051", [("localhost", 50051)]),
    ("retriever", [("retriever", None)]),
    ("[::1]:50052", [("::1", 50052)]),
    ("dns:///retriever:50051", [("retriever", 50051)]),
    ("dns://10.0.0.2:53/policy:50052", [("10.0.0.2", 53), ("policy", 50052)]),
    ("ipv4:127.0.0.1:1,127.0.0.2:2", [("127.0.0.1", 1), ("127.0.0.2", 2)]),
    ("ipv6:[::1]:5,[::1]:6", [("::1", 5), ("::1", 6)]),
])
def test_every_address_a_grpc_target_dials_is_read(target, expect):
    assert v.parse_target(target) == expect


@pytest.mark.parametrize("target", ["", "unix:/var/run/docker.sock", "xds:///svc", "host:99999", "host:x",
                                    "[::1", "ho st:1"])
def test_targets_that_cannot_be_read_or_checked_are_refused(target):
    with pytest.raises(InvalidArgument):
        v.parse_target(target, "config.retriever")


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "127.5.6.7:1", "localhost:50051", "LOCALHOST:1", "[::1]:50052",
                                    "[::ffff:127.0.0.1]:1", "retriever:50051", "policy:50052", "prm:50053",
                                    "judge:50054", "prorag-retriever:50051",
                                    "prorag-policy.prorag.svc.cluster.local:50052", "dns:///judge:50054",
                                    "ipv4:127.0.0.1:1,127.0.0.2:1", "0.0.0.0:50051"])
def test_loopback_and_the_service_names_are_allowed_by_default(target):
    v.check_endpoint("config.retriever", target, ALLOWED)


@pytest.mark.parametrize("target, shown", [
    ("evil.example:50051", "evil.example:50051"),
    ("10.0.0.1:50051", "10.0.0.1:50051"),
    ("127.evil.example:1", "127.evil.example:1"),  # a name that looks like a loopback address is a name
    ("retriever.evil.example:1", "retriever.evil.example:1"),
    ("ipv4:127.0.0.1:1,10.9.9.9:2", "10.9.9.9:2"),
    ("dns://8.8.8.8/retriever:50051", "8.8.8.8"),  # the DNS server it would ask is dialled too
    ("169.254.169.254:80", "169.254.169.254:80"),
])
def test_other_endpoints_are_refused_naming_field_and_address(target, shown):
    with pytest.raises(InvalidArgument) as ei:
        v.check_endpoint("config.retriever", target, ALLOWED)
    msg = str(ei.value)
    assert msg.startswith(f"config.retriever {target!r}: ") and "allowed endpoints" in msg
    assert shown in msg


def test_urls_are_checked_by_host_and_port():
    v.check_url("config.openai_base_url", "http://127.0.0.1:8001/v1", ALLOWED)
    v.check_url("config.openai_base_url", "http://policy:8001/v1", ALLOWED)
    with pytest.raises(InvalidArgument, match="evil.example:443 is not on"):
        v.check_url("config.openai_base_url", "https://evil.example", ALLOWED)
    with pytest.raises(InvalidArgument, match="not an http"):
        v.check_url("config.openai_base_url", "file:///etc/passwd", ALLOWED)
    # a port on the pattern narrows it; user info in the URL does not fool the host check
    allowed = ["api.openai.com:443", "*.internal"]
    v.check_url("f", "https://api.openai.com/v1", allowed)
    v.check_url("f", "http://llm.internal:8000/v1", allowed)
    with pytest.raises(InvalidArgument):
        v.check_url("f", "http://api.openai.com:8080/v1", allowed)
    with pytest.raises(InvalidArgument, match="evil.example"):
        v.check_url("f", "https://api.openai.com@evil.example/v1", allowed)


def test_an_operators_allowlist_is_checked_when_it_is_given():
    assert v.check_allowed_endpoints(["10.0.0.0/8", "judge.internal:50054"]) == ["10.0.0.0/8", "judge.internal:50054"]
    v.check_endpoint("f", "10.1.2.3:1", ["10.0.0.0/8"])
    v.check_endpoint("f", "judge.internal:50054", ["judge.internal:50054"])
    with pytest.raises(InvalidArgument):
        v.check_endpoint("f", "judge.internal:50055", ["judge.internal:50054"])
    for bad in ([""], ["10.0.0.0/99"]):
        with pytest.raises(ValueError, match="allowed_endpoints"):
            v.check_allowed_endpoints(bad)


def test_nothing_is_allowed_by_an_empty_allowlist():
    with pytest.raises(InvalidArgument, match="none"):
        v.check_endpoint("f", "127.0.0.1:1", [])

