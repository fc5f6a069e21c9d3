"""The steps the stages that sample through the policy service share (rl, rlpool, rft): which questions RL
draws from, one Rollout request, seeded and waited for; the answer F1 a trajectory earns; one PRM call over many
trajectories' steps. What each
stage does with the trajectories (drop stale ones, count a pool, filter for RFT) stays in the stage.

A config passed here is any object with the named fields (RLConfig, RLPoolConfig, RFTConfig): policy,
temperature, max_step_tokens, max_steps, topk, retriever_index, service_wait_s, and prm for :func:`prm_logits`;
tempered_logprobs where the config has it (RLConfig's: it reads the log-probs; the others, which do not, take the
policy engine's own kind).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

from prorag.config import cfg_field
from prorag.metrics import f1_score
from prorag.rpc.clients import call_with_service_wait, resolve_replicas


def select_questions(questions: list, min_hops: int = 0, max_questions: int = 0) -> list:
    """The RL questions (the rl and rlpool stages'): those of at least ``min_hops`` hops (0 = all), then the first
    ``max_questions`` (0 = all), in the split's order."""
    picked = [q for q in questions if q.hops >= min_hops]
    return picked[:max_questions] if max_questions else picked


def rollout_seed(seed: int, start: int, iteration: int = 0) -> int:
    """The sampling seed of the Rollout request for the questions from ``start`` on at RL iteration ``iteration``
    (0 for a pool): a function of the request's place alone, so a resumed job samples what an uninterrupted one
    would; folded into the positive 31-bit seeds the policy takes."""
    return (seed * 7919 + iteration * 100_003 + start + 1) % (2 ** 31 - 1) or 1


def rollout(policy, cfg, questions: list, n: int, seed: int, adapter: str, stats: dict, after_back=None) -> list:
    """One Rollout request: ``questions`` [q] sampled ``n`` times each with ``seed`` under cfg's sampling settings,
    from ``adapter`` ('' = the replica's active one). A policy target of several replicas (an ``ipv4:a:p,b:p`` list,
    a headless Service's name) gets the request as one part per replica, sent at once: each part names its first
    question's place (question_offset), so the parts sample what the whole request would, whatever the number of
    replicas. A policy that goes away (UNAVAILABLE) is waited for up to cfg.service_wait_s and the part made again
    with the same seed (after_back() first), so nothing is lost or counted twice. Returns the trajectories (pb)
    [q * n] question-major, sample-minor (the order of ``questions``), the stream's summary left out."""
    sampling = policy.sampling(n=n, temperature=cfg.temperature, max_tokens=cfg.max_step_tokens, seed=seed,
                               tempered_logprobs=getattr(cfg, "tempered_logprobs", None))
    parts = split_evenly(len(questions), replica_count(cfg.policy))

    def part(bounds: tuple[int, int]) -> list:
        lo, hi = bounds
        request = partial(_rollout_once, policy, cfg, questions[lo:hi], sampling, adapter, lo)
        got = call_with_service_wait(request, cfg.policy, "policy", cfg.service_wait_s, stats, after_back=after_back)
        return in_request_order([t for t in got if hasattr(t, "question_id")], questions[lo:hi])

    if len(parts) == 1:
        return part(parts[0])
    # threads: each part is a blocking gRPC stream; round robin sends them to different replicas
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        return [t for got in pool.map(part, parts) for t in got]


def replica_count(target: str) -> int:
    """How many policy replicas ``target`` reaches now (prorag.rpc.clients.resolve_replicas); 1 when its name does not
    resolve at this moment (a Service whose pods restart): the one request then waits for the policy as any call does
    (call_with_service_wait), where a failed lookup here would fail the job."""
    try:
        return len(resolve_replicas(target))
    except ValueError:
        return 1


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of ``count`` items in at most ``parts`` contiguous parts whose sizes differ by at most one
    (never an empty part; one part (0, 0) for no items).

    >>> split_evenly(5, 2)
    [(0, 3), (3, 5)]
    >>> split_evenly(1, 4)
    [(0, 1)]
    """
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def in_request_order(trajectories: list, questions: list) -> list:
    """``trajectories`` (pb, streamed as they finished) question-major, sample-minor in the order of ``questions``
    (a question asked twice keeps its trajectories' streamed order between the two), so what a stage does with them
    does not depend on which finished first, nor on how the request was split."""
    place: dict[str, int] = {}
    for i, q in enumerate(questions):
        place.setdefault(q.id, i)
    return sorted(trajectories, key=lambda t: (place.get(t.question_id, len(questions)), t.sample_index))


def _rollout_once(policy, cfg, questions: list, sampling, adapter: str, question_offset: int = 0) -> list:
    # the stream consumed whole, so a retried request never mixes with a broken one's partial results
    return list(policy.rollout([(q.id, q.question) for q in questions], sampling, max_steps=cfg.max_steps,
                               topk=cfg.topk, retriever_index=cfg.retriever_index, adapter=adapter,
                               question_offset=question_offset))


def answer_f1(trajectory, golden_answers) -> float:
    """The token F1 of a trajectory's answer against the gold answers; 0 when it stopped without answering."""
    return f1_score(trajectory.answer, golden_answers) if trajectory.finish_reason == "answer" else 0.0


def prm_logits(prm, cfg, inputs: list, stats: dict) -> tuple[str, list[list[float]]]:
    """One PRM call: inputs [N] (question, steps, last_step_only) -> (the PRM's version, its logits [N][steps of
    input i]); a PRM that goes away is waited for up to cfg.service_wait_s and asked again."""
    return call_with_service_wait(partial(prm.score, inputs), cfg.prm, "PRM", cfg.service_wait_s, stats)


# ---------------------------------------------------------------- settings the sampling stages declare alike
def rollout_index_field():
    """The setting of the retriever index a stage's rollouts search through the policy."""
    return cfg_field("", help="retriever index the policy's rollouts search ('' = its default)")


def rollout_topk_field(note: str = ""):
    """The setting of documents per subquery in a stage's rollouts; ``note`` adds the stage's reference values."""
    return cfg_field(1, help="documents per subquery, as the policy was trained" + note, min=1, max=20)


def step_tokens_field():
    """The setting of most tokens of one generated step in a stage's rollouts."""
    return cfg_field(128, help="most tokens of one generated step", min=8, max=4096)
