"""LLM-written thoughts for SFT trajectories (ProRAG rewrites its templates with GPT-4o).

Any OpenAI-compatible endpoint works (OpenAI, vLLM, this project's policy service). Every call
is cached on disk by its full request, so re-running data building costs nothing, and a failed
call (after retries) falls back to the offline template so a flaky endpoint never stops a job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path

from prorag.data.sft import template_thought
from prorag.io import append_jsonl_synced, read_jsonl_journal

log = logging.getLogger("prorag.data.thoughts")

_INSTRUCTION = {
    "search": "Write one short first-person sentence explaining why you will now search for: {q}",
    "read": "Write one short first-person sentence saying the retrieved documents answered: {q}",
    "final": "Write one short first-person sentence saying you can now give the final answer.",
    "compare": "Write one short first-person sentence saying that comparing the facts found answers the question.",
    "direct": "Write one short first-person sentence saying you will answer from memory.",
    "grounded": "Write one short first-person sentence saying the documents contain the answer.",
}


class OpenAIThoughtWriter:
    """Callable like :func:`prorag.data.sft.template_thought`: (kind, question_id, ctx) -> thought."""

    def __init__(self, base_url: str, model: str, cache_path: str | Path, api_key: str | None = None,
                 max_retries: int = 3, timeout: float = 30.0, max_tokens: int = 48):
        import openai

        self.client = openai.OpenAI(base_url=base_url or None,
                                    api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"),
                                    max_retries=max_retries, timeout=timeout)
        self.model = model
        self.max_tokens = max_tokens
        self.cache_path = Path(cache_path)
        self.cache: dict[str, str] = {}
        self.calls = 0
        self.fallbacks = 0
        self._lock = threading.Lock()
        # a torn last line from an interrupted run is skipped: that thought is asked for again
        self.cache.update((row["key"], row["thought"]) for row in read_jsonl_journal(self.cache_path)
                          if "key" in row and "thought" in row)

    def _key(self, prompt: str) -> str:
        return hashlib.sha256(json.dumps([self.model, prompt]).encode()).hexdigest()

    def __call__(self, kind: str, question_id: str, ctx: dict) -> str:
        fallback = template_thought(kind, question_id, ctx)
        prompt = _INSTRUCTION[kind].format(q=ctx.get("q", ""))
        key = self._key(prompt)
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        try:
            resp = self.client.chat.completions.create(
                model=self.model, max_tokens=self.max_tokens, temperature=0.7,
                messages=[{"role": "user", "content": prompt}])
            # tags are actions in the step format: never let one into a thought
            text = " ".join(re.sub(r"<[^<>]*>", " ", resp.choices[0].message.content or "").split())
            self.calls += 1
        except Exception as e:  # noqa: BLE001 - any endpoint failure falls back to the template
            log.warning("thought rewrite failed (%s); using the template", e)
            self.fallbacks += 1
            return fallback
        if not text or "<" in text or ">" in text:
            self.fallbacks += 1
            return fallback
        with self._lock:
            self.cache[key] = text
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl_synced(self.cache_path, {"key": key, "thought": text})
        return text
