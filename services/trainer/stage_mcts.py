"""Stage "mcts": search over reasoning steps for train questions through the policy and retriever services,
saving the trees and the sibling pairs the PRM trains on: every pair of visited, format-valid, content-distinct
siblings (prorag.search.mcts.extract_pairs), labelled by value margin, and by the judge service when one is given; the
metrics count them per step kind (``pairs_by_kind.<kind>.<pairs|value_labelled|judge_labelled>``).

Many questions are searched at once (``concurrency`` threads), so the policy service merges their step
requests into shared engine calls; retrieval goes through one cache for the whole run. Each finished question
is appended (fsynced) to a journal in the checkpoint directory, so a stopped or killed job resumes with the
questions it has not finished.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from prorag.config import cfg_field
from prorag.io import write_jsonl
from prorag.rpc.clients import JudgeClient, call_with_service_wait
from prorag.search.mcts import MCTSConfig, extract_pairs, search
from prorag.search.pairs import StepPair, label_agreement
from prorag.training.context import JobContext
from services.trainer.search_env import SearchServices, resume_questions, run_questions
from services.trainer.stages import PolicySamplingConfig, register_stage, resolve_model


#: what the pairs of a tree are, for job reuse (prorag_app.stage2): 2 = every pair of visited, valid, distinct
#: siblings (1 was the best against the worst sibling by value, invalid ones included, near-duplicates merged)
PAIRS_VERSION = 2


@dataclass
class MCTSStageConfig(PolicySamplingConfig):
    """Search train questions with MCTS through the services; write trees and sibling pairs."""

    world: str = cfg_field("default", help="embedded world whose questions are searched")
    split: str = cfg_field("train", help="split of the world to search (never the test split's questions for "
                                         "training data)")
    max_questions: int = cfg_field(200, help="questions searched, the split's first ones (0 = all)", min=0)
    judge: str = cfg_field("", help="judge service that labels each pair ('' = value-margin labels only)")
    mcts: MCTSConfig = cfg_field(help="the search: simulations, expansions, widening, depth, PUCT c, discount, "
                                      "rollouts, per-question budgets", factory=MCTSConfig)
    temperature: float = cfg_field(1.0, help="sampling temperature of expansions", min=0.0, max=5.0)
    rollout_temperature: float = cfg_field(1.0, help="sampling temperature of rollouts", min=0.0, max=5.0)
    min_margin: float = cfg_field(0.01, help="value margin from which a pair gets a value label", min=0.0)


def judge_pairs(client, questions: dict, pairs: list) -> None:
    """Set judge_choice / judge_reason of each pair from the judge service (chosen = its pick when it also
    rejects the other; None when it declines)."""
    for i in range(0, len(pairs), 64):
        chunk = pairs[i:i + 64]
        verdicts = client.judge([(f"{k}", p.question_id, p.question, questions[p.question_id].golden_answers,
                                  p.context, list(p.steps), list(p.values), list(p.visits))
                                 for k, p in enumerate(chunk)])
        for p, v in zip(chunk, verdicts):
            p.judge_choice = v.chosen if v.chosen in (0, 1) and v.rejected == 1 - v.chosen else None
            p.judge_reason = v.rationale


def pair_counts(pairs: list) -> dict[str, dict[str, int]]:
    """{step kind: {"pairs", "value_labelled", "judge_labelled"}} of ``pairs`` (StepPair), by meta["step_kind"]
    (pairs written before pairs carried it: "?")."""
    out: dict[str, dict[str, int]] = {}
    for p in pairs:
        c = out.setdefault(p.meta.get("step_kind", "?"), {"pairs": 0, "value_labelled": 0, "judge_labelled": 0})
        c["pairs"] += 1
        c["value_labelled"] += p.value_choice is not None
        c["judge_labelled"] += p.judge_choice is not None
    return dict(sorted(out.items()))


def flat_counts(by_kind: dict[str, dict[str, int]], prefix: str = "pairs_by_kind") -> dict[str, int]:
    """A nested count dict as job metrics (numbers only): {"<prefix>.<kind>.<count>": n}; what
    prorag_app.stage2.counts_by_kind reads back."""
    return {f"{prefix}.{kind}.{name}": n for kind, counts in by_kind.items() for name, n in counts.items()}


def run_mcts(ctx: JobContext) -> dict:
    from transformers import AutoTokenizer  # heavy: imported when a job runs, not when the trainer registers stages

    cfg: MCTSStageConfig = ctx.config
    qs, by_id, journal, done, todo = resume_questions(ctx, cfg, "mcts-journal.jsonl", "searched")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(cfg.world, cfg.policy_model, "policy_model")))

    clients = SearchServices(cfg)
    started = time.monotonic()

    def search_one(q) -> dict:
        env = clients.env(tokenizer, q, (cfg.seed * 7919 + hash_id(q.id)) if cfg.seed else 0, cfg.mcts.max_depth,
                          rollout_temperature=cfg.rollout_temperature)
        root, stats = search(env.expand, env.rollout, env.reward, cfg.mcts)
        pairs = extract_pairs(root, q.id, q.question, min_margin=cfg.min_margin)
        return {"question_id": q.id, "tree": root.to_dict(), "pairs": [p.to_dict() for p in pairs],
                "stats": {"simulations": stats.simulations, "tokens": stats.tokens, "seconds": stats.seconds,
                          "stopped_by": stats.stopped_by}}

    with clients:
        fresh = run_questions(ctx, todo, search_one, concurrency=cfg.concurrency, thread_name="mcts",
                              journal=journal, done=done, total=len(qs))
        sims_here = sum(r["stats"]["simulations"] for r in fresh)
        wall = time.monotonic() - started
        rows = [done[q.id] for q in qs]
        pairs = [StepPair.from_dict(p) for r in rows for p in r["pairs"]]
        if cfg.judge:
            with JudgeClient(cfg.judge, timeout=600) as judge:
                # asked again whole: the pairs a first try labelled get the same verdicts again
                call_with_service_wait(lambda: judge_pairs(judge, by_id, pairs), cfg.judge, "judge",
                                       cfg.service_wait_s, clients.waits["judge"])

    with ctx.artifact_file("pairs", "pairs.jsonl") as tmp:
        write_jsonl(tmp, (p.to_dict() for p in pairs))
    with ctx.artifact_file("trees", "trees.jsonl") as tmp:
        write_jsonl(tmp, ({"question_id": r["question_id"], "stats": r["stats"], "tree": r["tree"]} for r in rows))
    sims = sum(r["stats"]["simulations"] for r in rows)
    tokens = sum(r["stats"]["tokens"] for r in rows)
    agreement = label_agreement(pairs)
    by_kind = pair_counts(pairs)
    metrics = {
        "questions": len(rows), "simulations": sims, "generated_tokens": tokens, "pairs": len(pairs),
        "pairs_per_question": len(pairs) / len(rows),
        "value_labelled": sum(p.value_choice is not None for p in pairs),
        "judge_labelled": sum(p.judge_choice is not None for p in pairs),
        "both_labelled": agreement["both_labelled"],
        "simulations_per_s": sims_here / wall if wall > 0 else 0.0, "wall_s": wall,
        "stopped_by_budget": sum(r["stats"]["stopped_by"] != "simulations" for r in rows),
        **clients.metrics(),
        # the nested counts reach the manifest; a job's metrics over the API are numbers, so they also go flat
        "pairs_by_kind": by_kind, **flat_counts(by_kind),
    }
    if agreement["both_labelled"]:
        metrics["judge_value_agreement"] = agreement["agreement"]
    ctx.emit(len(qs), len(qs), message=f"{len(pairs)} pairs from {len(rows)} questions; cache hit rate "
                                       f"{clients.cache.hit_rate:.0%}")
    return {**metrics, "pairs_path": str(ctx.run_dir / "pairs.jsonl")}


def hash_id(question_id: str) -> int:
    return int(hashlib.sha256(question_id.encode()).hexdigest()[:8], 16)


register_stage("mcts", MCTSStageConfig, run_mcts,
               description="MCTS over reasoning steps through the policy and retriever services: trees and "
                           "sibling pairs (value-margin labels, judge labels when a judge is given)")
