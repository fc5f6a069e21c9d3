"""Stage "siblings": judged sibling pairs without a tree search, sampled along the policy's own trajectories.

The reference judge labels a step on its own (right entity for the open hop, a sub-answer the documents support, no
repeated search), so a pair needs no value estimate, only two alternatives under one context. For each train question
this stage samples one on-policy trajectory step by step through the policy service and, at each of its prefixes,
``samples`` more next steps (one call of ``samples + 1`` completions: the first continues the trajectory, and is a
sibling too). Subqueries are searched as the agent would (services.trainer.search_env.ServiceEnv). Invalid siblings are
dropped and copies (same kind, same normalised content) removed (prorag.search.mcts.pairable); every pair of the rest is
a StepPair (no values or visits, no value label, ``meta = {"step_kind", "source": "siblings"}``) that the judge service
labels. The output is the MCTS stage's ``pairs.jsonl`` format, so the PRM stage trains on it as it is (alone, or with
the MCTS pairs through its ``extra_pairs``).

On-policy siblings almost never hold the contrast a PRM most needs on deep questions: a name the documents do not
support (the agent's wrong sub-answers are wrong names it read, rarely unsupported ones). With ``reading_samples``,
each prefix that ends with a search also gets sub-answers sampled as if the search had returned other documents
(:func:`reading_contexts`) and judged in the real context: pairs that contrast reading with not reading, made by
the policy itself (the PRM's validation builds its cases by rewriting gold trajectories, not by sampling). With
``bridge_samples``, each prefix that ends with a sub-answer also gets next steps sampled as if that sub-answer had
named another question's hop answer; the subqueries among them, judged in the real context, search the wrong
entity: pairs that contrast carrying the name just read forward with carrying another (reading pairs alone taught
the PRM sub-answers and left it ranking gold bridge subqueries below corrupted ones). With ``relation_samples``, each
prefix that ends with a search also gets sub-answers sampled as if the subquery had asked another relation of the
same entity (a train question's hop about an entity of the same kind, of a relation this one has, its entity
replaced) over the same documents: judged in the real
context, they name what the documents say about something else, the in-document distractor a PRM must read past.

Many questions run at once (``concurrency`` threads) so the policy service merges their step requests; each
question's pairs are judged and appended (fsynced) to a journal in the checkpoint directory as soon as the question
is done, so a stopped or killed job resumes with the questions it has not finished and never judges a pair twice.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from prorag import paths
from prorag.algorithms.mcts import pair_kind, sibling_pairs
from prorag.config import ConfigError, cfg_field
from prorag.data.loaders import Document, load_split
from prorag.data.world.config import TEST_SPLITS
from prorag.data.world.files import entity_relations
from prorag.errors import InvalidArgument
from prorag.io import write_jsonl
from prorag.metrics import normalize_answer
from prorag.prm.evaluation import entity_surface
from prorag.rpc.clients import JudgeClient, call_with_service_wait
from prorag.search.mcts import pairable
from prorag.search.pairs import StepPair
from prorag.training.context import JobContext
from services.trainer.search_env import SearchServices, resume_questions, run_questions
from services.trainer.stage_mcts import flat_counts, hash_id, judge_pairs, pair_counts
from services.trainer.stages import PolicySamplingConfig, register_stage, resolve_model


#: what the stage samples and pairs, for job reuse (prorag_app.stage2): a change that makes other pairs from the
#: same settings bumps it
SIBLINGS_VERSION = 2
#: the same for what relation_samples asks (part of a job's key only when it has relation samples, so a change here
#: re-runs only those jobs): 2 = an entity is asked only the relations of its kind that it has
RELATION_VERSION = 2


@dataclass
class SiblingsStageConfig(PolicySamplingConfig):
    """Sample sibling steps at each prefix of on-policy trajectories; pair them and label the pairs by the judge."""

    world: str = cfg_field("default", help="embedded world whose questions are sampled")
    split: str = cfg_field("train", help="split of the world to sample (never test: these are training data)")
    max_questions: int = cfg_field(1000, help="questions sampled, the split's first ones (0 = all)", min=0)
    judge: str = cfg_field("", help="required: judge service that labels every pair (the pairs have no value "
                                    "label, so without a judge nothing could train on them)")
    samples: int = cfg_field(4, help="next steps sampled at each prefix beside the trajectory's own", min=1, max=63)
    temperature: float = cfg_field(1.0, help="sampling temperature of the trajectory and of its siblings",
                                   min=0.0, max=5.0)
    max_steps: int = cfg_field(10, help="deepest step of a trajectory (its prefixes: 0 .. max_steps - 1 steps)",
                               min=1, max=64)
    reading_samples: int = cfg_field(
        0, help="at each prefix that ends with a search: sub-answers sampled as if the search had returned other "
                "documents (its top document removed; the sentences naming the trajectory's sub-answer removed; "
                "another question's documents), judged in the real context, "
                "so pairs contrast a sub-answer the documents support with one they do not (0 = none)",
        min=0, max=32)

    bridge_samples: int = cfg_field(
        0, help="at each prefix that ends with a sub-answer: next steps sampled as if that sub-answer had named "
                "another question's hop answer; the subqueries among them are judged in the real context, so pairs "
                "contrast a search for the entity just read with a search for another (0 = none)",
        min=0, max=32)

    relation_samples: int = cfg_field(
        0, help="at each prefix that ends with a search: sub-answers sampled as if the subquery had asked another "
                "relation of the same entity (a train question's hop about an entity of the same kind, of a relation "
                "this entity has, its entity replaced) over the same documents, judged in the real context, so pairs "
                "contrast the name that answers the question asked with another name the same documents give "
                "(0 = none)",
        min=0, max=32)

    def validate(self) -> None:
        super().validate()
        if not self.judge:
            raise ConfigError("judge", "required: the judge service (host:port) that labels the sibling pairs; "
                                       "they carry no value label")
        if self.split in TEST_SPLITS:
            raise ConfigError("split", f"{self.split!r} is held out for evaluation; sample the train (or dev) split")


def without_sentences_naming(docs: list, name: str) -> list:
    """``docs`` with every sentence that names ``name`` (case-insensitive) taken out of their text; [] when no
    document names it, or nothing would be left. Where the policy read its sub-answer, it must then name something
    else the same documents say."""
    name = " ".join(name.split())
    if not name:
        return []
    # the whole name, not a substring: "Ana Berg" must not take out a sentence about "Ana Bergson"
    names = re.compile(r"(?<!\w)" + re.escape(name).replace(r"\ ", r"\s+") + r"(?!\w)", re.IGNORECASE)
    if not any(names.search(f"{d.title} {d.text}") for d in docs):
        return []
    out = []
    for d in docs:
        kept = [x for x in re.split(r"(?<=[.!?])\s+", d.text) if not names.search(x)]
        if kept:
            out.append(Document.from_parts(d.id, d.title, " ".join(kept)))
    return out


def reading_contexts(docs: list, decoy: list, said: str = "") -> list[list]:
    """The other documents a search's sub-answer is sampled under (stage option reading_samples), each set left out
    when empty: ``docs`` without their top document (when more than one: the policy must read further down, or
    names what is left); ``docs`` without the sentences that name ``said`` (the sub-answer the policy gave from
    the real documents: it then names something else those documents say, a name in them that is not what it
    read); and ``decoy``, another question's documents (what it names there the real documents mostly lack)."""
    return [d for d in (docs[1:] if len(docs) > 1 else [], without_sentences_naming(docs, said) if said else [],
                        decoy) if d]


#: stands for the entity in a relation template (no question contains braces)
ENTITY = "{entity}"


def hop_relations(question) -> dict[str, str]:
    """document id -> the relation ``question``'s chain asks of it (a generated world records the chain as
    ``DOCID.relation`` segments joined by ``>`` and ``&``); {} for a question without one.

    >>> from prorag.data.loaders import Question
    >>> hop_relations(Question("q", "?", ["x"], metadata={"chain": "W1.creator>P2.birth_year&P3.birth_year"}))
    {'W1': 'creator', 'P2': 'birth_year', 'P3': 'birth_year'}
    """
    chain = question.metadata.get("chain") or ""
    segments = [x.split(".", 1) for part in chain.split(">") for x in part.split("&")]
    return {seg[0]: seg[1] for seg in segments if len(seg) == 2 and seg[0] and seg[1]}


@dataclass(frozen=True)
class RelationTemplates:
    """The relations a relation sample may ask of an entity: hop questions with their entity replaced by
    :data:`ENTITY`, by the kind of entity they were asked of and the relation they ask ("" where unknown), and the
    kind and relations of each document's entity (prorag.data.world.files.entity_relations; empty for a corpus that
    is not a generated world). Asking a city "Who directed {entity}?" gets a made-up name, not a name its document
    gives, so an entity is asked only what entities of its kind are asked and it has."""

    by_kind_relation: Mapping[tuple[str, str], tuple[str, ...]]
    entities: Mapping[str, tuple[str, frozenset]] = field(default_factory=dict)

    def of(self, doc_id: str, asked: str = "", entity: str = "") -> list[str]:
        """The templates to ask of document ``doc_id``'s entity, sorted (every template when its entity is unknown),
        less every phrasing of the relation ``asked`` asks of ``entity`` (known when one of its templates, filled
        with ``entity``, is ``asked`` under the answer normaliser): another phrasing would get the same answer."""
        known = self.entities.get(doc_id)
        groups = [(relation, ts) for (kind, relation), ts in self.by_kind_relation.items()
                  if known is None or (kind == known[0] and (not relation or relation in known[1]))]
        if asked and entity:
            said = normalize_answer(asked)
            same = {r for r, ts in groups if r and any(normalize_answer(t.replace(ENTITY, entity)) == said for t in ts)}
            groups = [(r, ts) for r, ts in groups if r not in same]
        return sorted({t for _, ts in groups for t in ts})


def relation_templates(questions: list, entities: Mapping[str, tuple[str, frozenset]] | None = None
                       ) -> RelationTemplates:
    """Every hop question of ``questions`` that names its hop's entity (the document title as text names it), with
    the entity replaced by :data:`ENTITY`, keyed by the kind of its document's entity in ``entities`` (doc id ->
    (kind, relations)) and the relation its question's chain asks there. Sorted and distinct, so a job picks the same
    ones again."""
    entities = dict(entities or {})
    out: dict[tuple[str, str], set] = {}
    for q in questions:
        relations = hop_relations(q)
        for hop in q.decomposition:
            name = entity_surface(hop.title) if hop.title else ""
            if name and name in hop.question:
                key = (entities.get(hop.doc_id, ("", frozenset()))[0], relations.get(hop.doc_id, ""))
                out.setdefault(key, set()).add(hop.question.replace(name, ENTITY))
    return RelationTemplates({k: tuple(sorted(v)) for k, v in sorted(out.items())}, entities)


def relation_question(templates: list, asked: str, entity: str, key: int) -> str:
    """Another relation of ``entity`` to ask over the documents ``asked`` retrieved: the template at ``key`` (mod
    their number) among those that, filled with ``entity``, differ from ``asked``; "" when ``asked`` does not name
    ``entity`` (a search about something else) or no template differs.

    >>> relation_question(["Where was {entity} born?", "Who directed {entity}?"], "Where was Ana Berg born?",
    ...                   "Ana Berg", 7)
    'Who directed Ana Berg?'
    """
    if not entity or entity not in asked:
        return ""
    asked_norm = normalize_answer(asked)
    other = [t.replace(ENTITY, entity) for t in templates]
    other = [x for x in other if normalize_answer(x) != asked_norm]
    return other[key % len(other)] if other else ""


def bridge_name(decoy_answers: list, history: list) -> str:
    """The name a bridge sample carries forward instead of ``history``'s last sub-answer: the decoy question's
    hop answer at the same hop (the last one when the decoy has fewer), "" when none differs from what was said.

    >>> from prorag.trajectory import Step
    >>> bridge_name(["Ekroa", "Lasar"], [Step("subanswer", content="Yxine")])
    'Ekroa'
    """
    said = normalize_answer(history[-1].content)
    hop = sum(s.kind == "subanswer" for s in history) - 1
    names = [a for a in decoy_answers if a and normalize_answer(a) != said]
    return names[min(hop, len(names) - 1)] if names else ""


@dataclass(frozen=True)
class Counterfactuals:
    """The counterfactual samples of one question (the stage's ``*_samples`` options, with what they draw on).

    reading_samples: at a prefix that ends with a searched subquery, that many sub-answers per
    :func:`reading_contexts` set (``env.expand_reading``; ``decoy_docs()`` gives the other question's documents),
    paired with the rest in the real context (``meta["source"] = "siblings-reading"`` when a pair holds one).

    bridge_samples: at a prefix that ends with a sub-answer, that many next steps as if it had named
    :func:`bridge_name` of ``decoy_answers`` (``env.expand_bridge``); the subqueries among them are paired with the
    rest (``meta["source"] = "siblings-bridge"``).

    relation_samples: at a prefix that ends with a searched subquery that names its top document's entity, that
    many sub-answers as if it had asked :func:`relation_question` of ``templates.of(top document id)`` over the
    same documents (``env.expand_relation``), paired with the rest (``meta["source"] = "siblings-relation"``).
    """

    reading_samples: int = 0
    decoy_docs: Callable[[], list] | None = None
    bridge_samples: int = 0
    decoy_answers: tuple[str, ...] = ()
    relation_samples: int = 0
    templates: RelationTemplates | None = None


def sample_question(env, question_id: str, question: str, samples: int, max_steps: int,
                    counterfactuals: Counterfactuals = Counterfactuals()):
    """One question's pairs: walk one trajectory through ``env`` (a services.trainer.search_env.ServiceEnv, or anything
    with its ``expand(history, n) -> (steps, tokens)`` and ``reward(steps)``), and at each prefix pair the trajectory's
    own step with ``samples`` more, keeping valid, distinct siblings (prorag.search.mcts.pairable), and the
    :class:`Counterfactuals` samples. The trajectory always continues with the real context's first sample.

    Returns (pairs [StepPair], stats {"prefixes", "sampled", "invalid", "duplicates", "tokens", "reading_sampled",
    "bridge_sampled", "relation_sampled", "steps", "f1"})."""
    history, pairs = [], []
    stats = {"prefixes": 0, "sampled": 0, "invalid": 0, "duplicates": 0, "tokens": 0, "reading_sampled": 0,
             "bridge_sampled": 0, "relation_sampled": 0}
    while len(history) < max_steps:
        # one call: the first completion continues the trajectory, the others are its siblings (i.i.d. samples)
        steps, tokens = env.expand(history, samples + 1)
        stats["tokens"] += tokens
        if not steps:  # the prefix reached the policy's length limit
            break
        stats["prefixes"] += 1
        stats["sampled"] += len(steps)
        candidates = list(steps)
        sources = ["siblings"] * len(steps)  # per candidate: what it was sampled under

        def add(other: list, tokens: int, kind: str, source: str) -> None:
            stats["tokens"] += tokens
            stats[source.split("-")[1] + "_sampled"] += len(other)
            kept = [s for s in other if s.kind == kind]
            candidates.extend(kept)
            sources.extend([source] * len(kept))

        cf = counterfactuals
        searched = bool(history) and history[-1].kind == "subquery" and bool(history[-1].docs)
        if cf.reading_samples and searched:
            said = steps[0].content if steps[0].kind == "subanswer" else ""
            decoy = list(cf.decoy_docs()) if cf.decoy_docs else []
            for docs in reading_contexts(list(history[-1].docs), decoy, said):
                # only sub-answers: a contrast in reading; another kind would be judged on a search never made
                add(*env.expand_reading(history, docs, cf.reading_samples), "subanswer", "siblings-reading")
        asked = ""
        if cf.relation_samples and cf.templates and searched:
            top, entity = history[-1].docs[0], entity_surface(history[-1].docs[0].title)
            asked = relation_question(cf.templates.of(top.id, history[-1].content, entity), history[-1].content,
                                      entity, hash_id(question_id) + len(history))
        if asked:
            add(*env.expand_relation(history, asked, cf.relation_samples), "subanswer", "siblings-relation")
        name = bridge_name(list(cf.decoy_answers), history) if cf.bridge_samples and history and \
            history[-1].kind == "subanswer" else ""
        if name:
            # only subqueries: they are judged as searches from the real context (the wrong entity, or not)
            add(*env.expand_bridge(history, name, cf.bridge_samples), "subquery", "siblings-bridge")
        valid = [s for s in candidates if s.valid and not s.empty]
        keep = pairable(candidates)
        stats["invalid"] += len(candidates) - len(valid)
        stats["duplicates"] += len(valid) - len(keep)
        for i, j in sibling_pairs(len(keep)):
            a, b = candidates[keep[i]], candidates[keep[j]]
            # the later candidate's: a pair of the real siblings is "siblings", any other holds a counterfactual one
            pairs.append(StepPair(question_id, question, list(history), (a, b),
                                  meta={"step_kind": pair_kind(a.kind, b.kind), "source": sources[keep[j]]}))
        history.append(steps[0])
        if steps[0].kind in ("answer", "invalid"):
            break
    stats["steps"] = len(history)
    stats["f1"] = env.reward(history) if history else 0.0
    return pairs, stats


def decoy_question(questions: list, question):
    """Another question of ``questions`` than ``question``, fixed by its id (a resumed or repeated job picks the
    same one): the search whose documents stand in for the real ones in reading_contexts, and whose hop answers
    the bridge samples carry forward."""
    others = [q for q in questions if q.id != question.id]
    if not others:
        raise InvalidArgument("reading_samples and bridge_samples need at least two questions (another question's "
                              "documents and hop answers are the decoy); raise max_questions")
    return others[hash_id(question.id) % len(others)]


def reason_counts(pairs: list, top: int = 8) -> dict[str, dict[str, int]]:
    """{step kind: {reason: pairs}} of judged ``pairs``, the ``top`` commonest per kind: "rejected: <why>" for a
    labelled pair (the judge service's words on the rejected candidate, "candidate <i>: <why>"; an LLM judge's free
    text as it is), "declined: <why>" for the others (the text before its first " ("), cut to 80 characters."""
    by_kind: dict[str, Counter] = {}
    for p in pairs:
        text = p.judge_reason or ""
        if p.judge_choice is not None:
            said = re.search(rf"candidate {1 - p.judge_choice}: ([^;]*)", text)
            reason = f"rejected: {(said.group(1) if said else text).strip()}"
        else:
            reason = f"declined: {text.split(' (')[0].strip() or '-'}"
        by_kind.setdefault(p.meta.get("step_kind", "?"), Counter())[reason[:80]] += 1
    return {k: dict(c.most_common(top)) for k, c in sorted(by_kind.items())}


def run_siblings(ctx: JobContext) -> dict:
    from transformers import AutoTokenizer  # heavy: imported when a job runs, not when the trainer registers stages

    cfg: SiblingsStageConfig = ctx.config
    qs, by_id, journal, done, todo = resume_questions(ctx, cfg, "siblings-journal.jsonl", "sampled")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(cfg.world, cfg.policy_model, "policy_model")))

    # drawn before anything is sampled: a job that cannot have decoys fails at its start
    decoys = {q.id: decoy_question(qs, q) for q in qs} if cfg.reading_samples or cfg.bridge_samples else {}
    # the relations are read off the whole split, so a job on few questions still knows every relation of a kind
    templates = relation_templates(load_split(paths.world_dir(cfg.world), cfg.split),
                                   entity_relations(paths.world_dir(cfg.world))) if cfg.relation_samples else None
    clients = SearchServices(cfg)
    judge = JudgeClient(cfg.judge, timeout=600)
    started = time.monotonic()

    def sample_one(q) -> dict:
        env = clients.env(tokenizer, q, (cfg.seed * 7919 + hash_id(q.id)) if cfg.seed else 0, cfg.max_steps)
        decoy = decoys.get(q.id)
        pairs, stats = sample_question(env, q.id, q.question, cfg.samples, cfg.max_steps, Counterfactuals(
            reading_samples=cfg.reading_samples,
            decoy_docs=(lambda: clients.cache(decoy.question)) if decoy else None,
            bridge_samples=cfg.bridge_samples,
            decoy_answers=tuple(h.answer for h in decoy.decomposition if h.answer) if decoy else (),
            relation_samples=cfg.relation_samples, templates=templates))
        # judged before the question is journalled: a resumed job never pays for a verdict twice (a judge
        # cache answers a question asked again after a restart)
        t = time.monotonic()
        call_with_service_wait(lambda: judge_pairs(judge, by_id, pairs), cfg.judge, "judge",
                               cfg.service_wait_s, clients.waits["judge"])
        stats["judge_s"] = time.monotonic() - t
        return {"question_id": q.id, "pairs": [p.to_dict() for p in pairs], "stats": stats}

    try:
        fresh = run_questions(ctx, todo, sample_one, concurrency=cfg.concurrency, thread_name="siblings",
                              journal=journal, done=done, total=len(qs))
    finally:
        clients.close()
        judge.close()
    wall = time.monotonic() - started
    rows = [done[q.id] for q in qs]
    pairs = [StepPair.from_dict(p) for r in rows for p in r["pairs"]]
    with ctx.artifact_file("pairs", "pairs.jsonl") as tmp:
        write_jsonl(tmp, (p.to_dict() for p in pairs))

    def total(key: str):
        return sum(r["stats"][key] for r in rows)

    by_kind = pair_counts(pairs)
    metrics = {
        "questions": len(rows), "pairs": len(pairs), "pairs_per_question": len(pairs) / len(rows),
        "judge_labelled": sum(p.judge_choice is not None for p in pairs),
        "prefixes": total("prefixes"), "siblings_sampled": total("sampled"), "siblings_invalid": total("invalid"),
        "siblings_duplicate": total("duplicates"), "generated_tokens": total("tokens"),
        "reading_sampled": sum(r["stats"].get("reading_sampled", 0) for r in rows),
        "reading_pairs": sum(p.meta.get("source") == "siblings-reading" for p in pairs),
        "reading_judge_labelled": sum(p.meta.get("source") == "siblings-reading" and p.judge_choice is not None
                                      for p in pairs),
        "bridge_sampled": sum(r["stats"].get("bridge_sampled", 0) for r in rows),
        "bridge_pairs": sum(p.meta.get("source") == "siblings-bridge" for p in pairs),
        "bridge_judge_labelled": sum(p.meta.get("source") == "siblings-bridge" and p.judge_choice is not None
                                     for p in pairs),
        "relation_sampled": sum(r["stats"].get("relation_sampled", 0) for r in rows),
        "relation_pairs": sum(p.meta.get("source") == "siblings-relation" for p in pairs),
        "relation_judge_labelled": sum(p.meta.get("source") == "siblings-relation" and p.judge_choice is not None
                                       for p in pairs),
        "trajectory_steps_mean": total("steps") / len(rows), "trajectory_f1_mean": total("f1") / len(rows),
        "wall_s": wall, "judge_wait_s": sum(r["stats"]["judge_s"] for r in fresh), **clients.metrics(),
        # the nested counts reach the manifest; a job's metrics over the API are numbers, so they also go flat
        "pairs_by_kind": by_kind, **flat_counts(by_kind), "judge_reasons_by_kind": reason_counts(pairs),
    }
    ctx.emit(len(qs), len(qs), message=f"{len(pairs)} pairs ({metrics['judge_labelled']} judge-labelled) from "
                                       f"{len(rows)} questions; " + ", ".join(
                                           f"{k}: {c['judge_labelled']}/{c['pairs']}" for k, c in by_kind.items()))
    return {**metrics, "pairs_path": str(ctx.run_dir / "pairs.jsonl")}


register_stage("siblings", SiblingsStageConfig, run_siblings,
               description="judged sibling pairs without tree search: n next steps sampled at each prefix of "
                           "on-policy trajectories through the policy and retriever services, every valid distinct "
                           "pair labelled by the judge service")
