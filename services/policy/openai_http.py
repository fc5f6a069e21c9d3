"""OpenAI-compatible HTTP on the policy (as vLLM offers): /v1/models, /v1/completions,
/v1/chat/completions, so the judge and other tools can use the policy with the openai client.

Stop sequences must be single tokens of the policy's tokenizer (the format's tags,
<|im_end|>): the engine stops on token ids, never on re-decoded text.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from prorag.errors import InvalidArgument, ProragError
from prorag.rpc.jsonbody import read_json
from prorag.trajectory import IM_END
from prorag.engine import SamplingSpec
from prorag.rollout import decode
from services.policy.frontend import PolicyFrontend


def _err(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def make_app(frontend: PolicyFrontend, model_name: str, max_body_mb: int = 16) -> web.Application:
    tok = frontend.tokenizer
    limits = frontend.limits

    checks = frontend.checks  # the limits and messages of the gRPC API (services.policy.requests)

    def sampling(body: dict, default_stop: list[str]) -> SamplingSpec:
        """The body's sampling: JSON types checked here, values by the shared checks."""
        n = body.get("n", 1)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", limits.default_step_tokens))
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        seed = body.get("seed")
        for name, v in (("n", n), ("max_tokens", max_tokens)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidArgument(f"{name} must be an integer")
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidArgument(f"{name} must be a number")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidArgument(f"seed must be a 64-bit integer, got {seed!r}")
        stop = body.get("stop") or default_stop
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise InvalidArgument(f'"stop" must be a string or a list of strings, got {type(stop).__name__}')
        # no kind of log-probs named: the engine's own, as vLLM's own server returns
        return checks.sampling(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed or 0,
                               stops=stop)

    async def run(prompts: list[list[int]], spec: SamplingSpec, adapter_req: str):
        limits.check_work(len(prompts) * spec.n * spec.max_tokens,
                          f"{len(prompts)} prompts x n={spec.n} x max_tokens={spec.max_tokens}")
        prompts = [checks.prompt_ids(i, p, "prompt") for i, p in enumerate(prompts)]
        return await frontend.generate(prompts, spec, adapter_req, time.monotonic() + limits.http_timeout_s)

    def check_prompts(texts: list[str], what: str = "prompt") -> None:
        # checked before tokenising: a huge string would hold the event loop in the tokenizer
        checks.count(len(texts), what + "s", limits.max_prefixes)
        for i, t in enumerate(texts):
            checks.text(i, t, what)

    def usage(prompts, outs):
        p = sum(len(x) for x in prompts)
        c = sum(len(s.token_ids) for seqs in outs for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def adapter_of(body: dict) -> str:
        # "model" may name an adapter (name@version), as vLLM serves LoRAs under their own names; the served
        # base model's own name@version means no adapter
        m = body.get("model") or ""
        if not isinstance(m, str):
            raise InvalidArgument(f'"model" must be a string (the served name or an adapter\'s name@version), got '
                                  f"{type(m).__name__}")
        return m if "@" in m and m != model_name else ""

    async def parse(request: web.Request) -> dict:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        return body

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await parse(request)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                prompt = [prompt]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) for p in prompt):
                raise InvalidArgument('"prompt" must be a string or a non-empty list of strings')
            check_prompts(prompt)
            spec = sampling(body, [IM_END])
            prompts = [tok.encode(p, add_special_tokens=False) for p in prompt]
            outs, adapter = await run(prompts, spec, adapter_of(body))
        except ProragError as e:
            return _err(e.http_status, str(e))
        want_lp = body.get("logprobs") is not None
        choices = []
        for i, seqs in enumerate(outs):
            for s in seqs:
                c = {"index": len(choices), "text": decode(tok, s.token_ids), "finish_reason": s.finish_reason}
                if want_lp:
                    c["logprobs"] = {"tokens": [decode(tok, [t]) for t in s.token_ids], "token_logprobs": s.logprobs}
                choices.append(c)
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                  "created": int(time.time()), "model": adapter or model_name,
                                  "choices": choices, "usage": usage(prompts, outs)})

    async def chat(request: web.Request) -> web.Response:
        try:
            body = await parse(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in
                    ("system", "user", "assistant") for m in messages):
                raise InvalidArgument('"messages" must be a non-empty list of {"role": system|user|assistant, '
                                      '"content": str}')
            spec = sampling(body, [IM_END])
            check_prompts([m["content"] for m in messages], what="message")
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts = [tok.encode(text, add_special_tokens=False)]
            outs, adapter = await run(prompts, spec, adapter_of(body))
        except ProragError as e:
            return _err(e.http_status, str(e))
        choices = []
        for s in outs[0]:
            ids = [t for t in s.token_ids if t not in spec.stop_token_ids]
            choices.append({"index": len(choices), "finish_reason": s.finish_reason,
                            "message": {"role": "assistant", "content": decode(tok, ids)}})
        return web.json_response({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                  "created": int(time.time()), "model": adapter or model_name,
                                  "choices": choices, "usage": usage(prompts, outs)})

    async def models(request: web.Request) -> web.Response:
        data = [{"id": model_name, "object": "model", "owned_by": "prorag"}]
        data += [{"id": k, "object": "model", "owned_by": "prorag", "parent": model_name}
                 for k in frontend.manager.loaded]
        return web.json_response({"object": "list", "data": data})

    app = web.Application(client_max_size=max_body_mb * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app
