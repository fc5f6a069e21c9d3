"""`prorag job`: a job config file (or stdin) with --set overrides to a real trainer over gRPC, followed to its end."""

from __future__ import annotations

import io
import json

import pytest

from prorag.rpc.service import ServeConfig
from services.trainer.server import TrainerConfig, start
from tests.helpers import LoopThread


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    loop = LoopThread()
    root = tmp_path_factory.mktemp("trainer") / "jobs"
    started = loop.run(start(ServeConfig(port=0, grace_s=1), TrainerConfig(jobs_root=str(root), tracking="local")))
    yield f"127.0.0.1:{started.grpc_port}"
    loop.run(started.stop())
    loop.close()


def test_a_config_file_with_overrides_runs_to_success(trainer, tmp_path, capsys):
    from prorag_app.cli import main

    cfg = tmp_path / "selftest.json"
    cfg.write_text(json.dumps({"steps": 400, "checkpoint_every": 10, "log_every": 5, "tracking": "local"}))
    assert main(["job", "start", "selftest", str(cfg), "--set", "steps=20", "--job-id", "cli-1", "--wait",
                 "--trainer", trainer, "--timeout", "120"]) == 0
    job = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (job["job_id"], job["state"], job["step"], job["total_steps"]) == ("cli-1", "SUCCEEDED", 20, 20)
    assert main(["job", "get", "cli-1", "--trainer", trainer]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "SUCCEEDED"


def test_stdin_placeholders_and_refusals_are_said_plainly(trainer, monkeypatch, capsys):
    from prorag_app.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO('{"base_model": "sft@REPLACE_WITH_SFT_JOB_ID", "steps": 5}'))
    assert main(["job", "start", "selftest", "-", "--trainer", trainer]) == 2
    assert "fill in base_model" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("[1, 2]"))
    assert main(["job", "start", "selftest", "-", "--trainer", trainer]) == 2
    assert "not a JSON object" in capsys.readouterr().err
    # the trainer's own check of the config comes back as its status, not a traceback
    monkeypatch.setattr("sys.stdin", io.StringIO('{"steps": -1}'))
    assert main(["job", "start", "selftest", "-", "--trainer", trainer]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["job", "get", "no-such-job", "--trainer", trainer]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err


def test_a_service_call_that_fails_is_said_plainly_with_how_to_go_on(monkeypatch, capsys):
    """A gRPC failure escaping a command (here a real call to a loopback port nobody serves) ends the command with
    its status and how to continue, not grpc's traceback."""
    import socket

    import grpc

    from prorag_app import cli

    with socket.socket() as s:  # a port that was free a moment ago: nothing answers there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def report_calling_a_dead_service(args):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            channel.unary_unary("/prorag.v1.Nothing/Call")(b"", timeout=2)
        return 0

    monkeypatch.setattr(cli, "cmd_report", report_calling_a_dead_service)
    assert cli.main(["report"]) == 1
    err = capsys.readouterr().err
    assert "a service call failed with UNAVAILABLE" in err and "run the same command again" in err
    assert "Traceback" not in err
