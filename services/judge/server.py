"""Judge service process: labels sibling reasoning steps (ProRAG's contrastive pairs)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.config import cfg_field
from prorag.errors import FailedPrecondition
from prorag.pb import judge_pb2_grpc
from prorag.rpc.grpc_server import ServerSpec
from prorag.rpc.service import ServeConfig, Started, start_grpc_and_http
from services.judge.engine import Budget, JudgeCache, OpenAIJudge, ReferenceJudge
from services.judge.frontend import JudgingFrontend
from services.judge.servicer import JudgeServicer

SERVICE = "prorag.v1.Judge"


@dataclass
class JudgeConfig:
    """Which judge answers and the limits it enforces on callers."""

    backend: str = cfg_field("reference", help="reference = ProRAG's rules checked against the world's gold "
                                               "decompositions (offline); openai = an OpenAI-compatible chat "
                                               "endpoint with ProRAG's judging prompt (GPT-4o in the paper)",
                             choices=("reference", "openai"))
    world: str = cfg_field("default", help="embedded world whose gold decompositions the reference judge reads")
    base_url: str = cfg_field("", help="openai: the endpoint ('' = api.openai.com), e.g. a vLLM server's /v1")
    model: str = cfg_field("gpt-4o", help="openai: the judging model")
    api_key_env: str = cfg_field("OPENAI_API_KEY", help="openai: environment variable holding the API key (the key "
                                                        "itself never goes in a config)")
    api_key_file: str = cfg_field("", help="openai: file holding the API key (a mounted Secret); wins over "
                                           "api_key_env when set")
    cache_path: str = cfg_field("", help="openai: JSONL cache of verdicts by request content ('' = "
                                         "data/cache/judge-<model>.jsonl)")
    max_calls: int = cfg_field(0, help="openai: most paid calls this process makes (0 = no limit); cached "
                                       "verdicts are always served", min=0)
    max_cost_usd: float = cfg_field(0.0, help="openai: most dollars this process spends (0 = no limit)", min=0.0)
    usd_per_m_input: float = cfg_field(2.5, help="openai: price per million prompt tokens", min=0.0)
    usd_per_m_output: float = cfg_field(10.0, help="openai: price per million completion tokens", min=0.0)
    timeout_s: float = cfg_field(60.0, help="openai: deadline of one HTTP request", min=0.1)
    max_retries: int = cfg_field(4, help="openai: retries with exponential backoff on connection errors, 429 and "
                                         "5xx", min=0, max=20)
    backoff_s: float = cfg_field(0.5, help="openai: first retry's wait when the endpoint names none (doubled per "
                                           "retry, jittered down by up to a quarter)", min=0.0, max=60.0)
    max_backoff_s: float = cfg_field(8.0, help="openai: the longest such wait", min=0.0, max=600.0)
    max_retry_after_s: float = cfg_field(30.0, help="openai: the longest Retry-After honoured; an endpoint asking "
                                                    "for more fails the call at once (UNAVAILABLE) rather than "
                                                    "hold the caller's RPC", min=0.0, max=3600.0)
    malformed_retries: int = cfg_field(2, help="openai: asks again when a reply holds no usable choice", min=0,
                                       max=10)
    concurrency: int = cfg_field(8, help="openai: requests in flight at once", min=1, max=256)
    max_items: int = cfg_field(256, help="most items in one request", min=1, max=100000)
    max_candidates: int = cfg_field(16, help="most sibling candidates in one item", min=2, max=1024)


def api_key(cfg: JudgeConfig) -> str:
    if cfg.api_key_file:
        try:
            return Path(cfg.api_key_file).read_text().strip()
        except OSError as e:
            raise FailedPrecondition(f"cannot read the judge's API key file {cfg.api_key_file}: {e}") from None
    return os.environ.get(cfg.api_key_env, "")


def open_engine(cfg: JudgeConfig):
    if cfg.backend == "reference":
        return ReferenceJudge.from_world(paths.world_dir(cfg.world))
    safe_model = re.sub(r"[^A-Za-z0-9._-]", "_", cfg.model)
    cache = cfg.cache_path or str(paths.data_dir() / "cache" / f"judge-{safe_model}.jsonl")
    return OpenAIJudge(cfg.base_url, cfg.model, JudgeCache(cache),
                       Budget(cfg.max_calls, cfg.max_cost_usd, cfg.usd_per_m_input, cfg.usd_per_m_output),
                       api_key=api_key(cfg), timeout_s=cfg.timeout_s,
                       max_retries=cfg.max_retries, malformed_retries=cfg.malformed_retries,
                       concurrency=cfg.concurrency, backoff_s=cfg.backoff_s, max_backoff_s=cfg.max_backoff_s,
                       max_retry_after_s=cfg.max_retry_after_s)


async def start(serve: ServeConfig, cfg: JudgeConfig | None = None, engine=None) -> Started:
    cfg = cfg or JudgeConfig()
    servicer = JudgeServicer(JudgingFrontend(engine or open_engine(cfg), cfg.max_items, cfg.max_candidates))
    spec = ServerSpec(name="judge",
                      services=[(SERVICE, lambda s: judge_pb2_grpc.add_JudgeServicer_to_server(servicer, s))])
    _, started = await start_grpc_and_http(serve, spec)  # the judge has no HTTP API
    return started
