"""Validation cases of a PRM: a sound step against a flawed one at the same position of the same trajectory.

Each case is (context, gold step, corrupted step): the steps before ``position`` of a gold trajectory (or of a
correct trajectory given by the caller, e.g. the agent's own), the step that was there, and a rewrite of it
that the reference judge (prorag.search.judging) rejects. A PRM that separates sound from flawed steps scores each gold
step above its corrupted counterpart; the AUC per family says how often.

Two sets of families:

- **in distribution** (:data:`CORRUPTIONS`, :func:`corrupt`): the flaws the judge's rules name, made the way the
  project first made them: a subquery naming a random other entity, a sub-answer the documents do not contain,
  a search repeated word for word, an answer given before the last hop was searched.
- **held out** (:data:`HELD_OUT`, :func:`corrupt_held_out`): deterministic rewrites (seeded choices) of a
  correct trajectory, built from what the trajectory and its documents already contain, never by sampling the
  policy. The PRM's training pairs are the policy's own sampled sibling steps labelled by the judge, so these
  are made by a mechanism independent of them; each still carries a flaw the judge names, so the PRM was
  trained on the criterion, just not on these cases. Why each one (what it tests that the others do not):

  ``in_document_distractor`` (sub-answer): another name (or number, when the answer is one) that *is* in the
      documents just retrieved but is not the hop's answer nor the searched entity. The corruption
      ``unsupported_subanswer`` names something absent from the documents, which a PRM can catch by lookup
      alone; this one needs reading. A sampled sibling can make this mistake, by chance; here the hardest
      candidate is chosen on purpose (same type as the answer: a year for a year, a name for a name).
  ``previous_answer_repeated`` (sub-answer): the last name the context already stated (the previous
      sub-answer, or the question's entity before any): an echo, present in the context and often in the
      document, so neither lookup nor novelty gives it away.
  ``wrong_final_from_chain`` (final answer, all hops read): an intermediate sub-answer of the chain given as the
      final answer: every name in it was read, only the composition is wrong. ``premature_answer`` answers
      at a subquery position, before the last hop: its position alone gives it away; this one does not.
  ``partial_entity`` (subquery): a near miss of the open hop's entity: another world entity sharing a word
      with it ("Yxine" for "Yxine City"), or the entity cut to its first or last word(s). ``swapped_entity``
      puts in an unrelated entity.
  ``skipped_hop`` (subquery): the trajectory's own later subquery that names the answer of the hop still
      open, asked before that answer was read: a leap over a hop to a name the context cannot have given.
      A policy cannot sample a name it has not read except by chance, so no training pair resembles it.
  ``answer_without_reading`` (final answer right after a subquery, before its documents were read and with
      hops still to go): the open hop's answer as the final answer. An answer step where the trained format
      always writes a sub-answer, so no sampled sibling resembles it either.

  Not included: a "surface" family (the gold step with another question's thought). The judge, whose labels
  the PRM learns, reads the content only, so a thought-only flaw is no flaw by the training's definition, and a
  gate on it would measure what the PRM was never asked to learn.

Every case kept by :func:`validation_cases` has a gold step the judge accepts and a corrupted one it rejects,
never equal to the gold step: a case that is not such a contrast would measure the judge's or the generator's
slips, not the PRM. :func:`auc_by_kind` reports per family and pooled (overall, in distribution, held out);
:func:`prm_gate` is the check before any PRM-guided stage. Pure functions: questions and steps in, cases out.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from prorag.errors import InvalidArgument
from prorag.evaluation import question_entity
from prorag.metrics import cover_exact_match, normalize_answer
from prorag.search.judging import judge_step, open_hop
from prorag.trajectory import Step

#: the in-distribution families (:func:`corrupt`)
CORRUPTIONS = ("swapped_entity", "unsupported_subanswer", "redundant_search", "premature_answer")
#: the held-out families (:func:`corrupt_held_out`)
HELD_OUT = ("in_document_distractor", "previous_answer_repeated", "wrong_final_from_chain", "partial_entity",
            "skipped_hop", "answer_without_reading")
FAMILIES = CORRUPTIONS + HELD_OUT
#: the families whose AUC is "unsupported sub-answer AUC" for :func:`prm_gate`: a sub-answer the documents do not
#: support, absent from them or present but not the answer (reading is what the deep questions fail on)
UNSUPPORTED_FAMILIES = ("unsupported_subanswer", "in_document_distractor")


@dataclass
class ProbeCase:
    """At ``position`` of question ``question_id``'s gold trajectory: the gold step and a ``kind`` corruption of
    it, both after the same ``context`` (the gold steps before)."""

    question_id: str
    question: str
    kind: str
    position: int
    context: list[Step]
    gold: Step
    corrupted: Step


def _swap(text: str, old: str, new: str) -> str | None:
    return text.replace(old, new) if old and old in text and old != new else None


def corrupt(question, steps: Sequence[Step], rng: random.Random, entities: Sequence[str],
            answers: Sequence[str]) -> list[ProbeCase]:
    """Every corruption that applies to ``steps`` (a gold trajectory: subquery, subanswer per hop, then the
    answer), at most one per kind, drawn with ``rng``.

    entities: names to swap into a subquery (any world entity); answers: sub-answers to put where the documents
    say something else (a replacement is never one the step's documents contain)."""
    hops = [s for s in question.decomposition if s.doc_id]
    subqueries = [i for i, s in enumerate(steps) if s.kind == "subquery"]
    subanswers = [i for i, s in enumerate(steps) if s.kind == "subanswer"]
    out: list[ProbeCase] = []

    def case(kind: str, pos: int, bad: Step) -> None:
        out.append(ProbeCase(question.id, question.question, kind, pos, list(steps[:pos]), steps[pos], bad))

    # swapped entity: the subquery asks about another entity than the one the question (or the last hop) names
    options = []
    for k, pos in enumerate(subqueries[:len(hops)]):
        named = question_entity(question) if k == 0 else hops[k - 1].answer
        others = [e for e in entities if e != named and e not in steps[pos].content]
        if others and named and named in steps[pos].content:
            options.append((pos, named, others))
    if options:
        pos, named, others = rng.choice(options)
        other = rng.choice(others)
        s = steps[pos]
        case("swapped_entity", pos, Step("subquery", thought=_swap(s.thought, named, other) or s.thought,
                                         content=s.content.replace(named, other)))
    # unsupported sub-answer: a name the documents just retrieved do not contain
    options = []
    for pos in subanswers:
        docs = steps[pos - 1].docs or []
        text = " ".join(f"{d.title} {d.text}" for d in docs)
        wrong = [a for a in answers if a and a != steps[pos].content and a not in text]
        if wrong:
            options.append((pos, wrong))
    if options:
        pos, wrong = rng.choice(options)
        case("unsupported_subanswer", pos, Step("subanswer", thought=steps[pos].thought, content=rng.choice(wrong)))
    # redundant search: the previous hop's subquery again instead of the next one
    later = subqueries[1:]
    if later:
        pos = rng.choice(later)
        prev = steps[max(p for p in subqueries if p < pos)]
        case("redundant_search", pos, Step("subquery", thought=steps[pos].thought, content=prev.content))
    # premature answer: answering with what is known so far while a hop is still to be searched; the thought is
    # the gold final answer's, so only the timing and the content give it away
    if later:
        pos = rng.choice(later)
        known = steps[pos - 1].content if steps[pos - 1].kind == "subanswer" else question_entity(question)
        final = steps[-1].thought if steps and steps[-1].kind == "answer" else ""
        case("premature_answer", pos, Step("answer", thought=final, content=known))
    return out


# ---------------------------------------------------------------- held-out families
_NAME = re.compile(r"[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*|\b\d{3,}\b")
_SENTENCE_START = re.compile(r"(?:^|[.!?]\s+|\n)$")
_PARENTHETICAL = re.compile(r"\s*\([^)]*\)\s*$")


def _tokens(text: str) -> set[str]:
    return set(normalize_answer(text).split())


def document_names(text: str) -> list[str]:
    """Names a passage mentions, in order, each once: runs of capitalised words and numbers of 3+ digits. A lone
    capitalised word opening a sentence ("The", "Born", "It") is left out: capitalised by position, not a name.

    >>> document_names("Theposk Brewery was founded in 1877 by Awarn Trosell. It employs 3810 people.")
    ['Theposk Brewery', '1877', 'Awarn Trosell', '3810']
    """
    out: list[str] = []
    for m in _NAME.finditer(text):
        name = m.group(0)
        if " " not in name and not name.isdigit() and _SENTENCE_START.search(text[:m.start()]):
            continue
        if name not in out:
            out.append(name)
    return out


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"\s*\d[\d,.]*\s*", text))


def _covers(text: str, names: Sequence[str]) -> bool:
    return bool(names) and cover_exact_match(text, list(names)) == 1.0


def _hop_answers(hop) -> list[str]:
    return [a for a in [hop.answer, *hop.answer_aliases] if a]


def entity_surface(title: str) -> str:
    """A document title as text names it: without a trailing disambiguation ("Grethmouth (city)" -> "Grethmouth")."""
    return _PARENTHETICAL.sub("", title).strip()


def _near_misses(entity: str, entities: Sequence[str], common: int = 5) -> list[str]:
    """Names one word off ``entity``: other entities sharing a distinctive word with it (one in at most
    ``common`` of ``entities``: "Yxine" for "Yxine City", not "Revyrnor City"), none containing it whole, then
    the entity cut to its first or last word(s) where the cut keeps a distinctive word. [] for a one-word entity
    with no such neighbour.

    >>> _near_misses("Yxine City", ["Yxine", "Yxine City", "Revyrnor City", "Lasar City", "Zaford"], common=2)
    ['Yxine']
    """
    df = Counter(w for e in set(entities) for w in _tokens(e))
    rare = {w for w in _tokens(entity) if df[w] <= common}
    words = entity.split()
    out = [e for e in entities if e != entity and _tokens(e) & rare and not _covers(e, [entity])]
    if len(words) > 1:
        # a cut left with only common words ("Software" of "Zyflearn Software") names no one in particular
        out += [c for c in (" ".join(words[:-1]), " ".join(words[1:])) if _tokens(c) & rare]
    return list(dict.fromkeys(out))


def _options_held_out(question, steps: Sequence[Step], entities: Sequence[str]) -> dict[str, list]:
    """family -> [(position, corrupted step)]: every rewrite of ``steps`` each held-out family can make."""
    opts: dict[str, list] = {k: [] for k in HELD_OUT}
    hops = question.decomposition
    retrieval = [k for k, h in enumerate(hops) if h.needs_retrieval]
    final = steps[-1] if steps and steps[-1].kind == "answer" else None
    for pos, gold in enumerate(steps):
        context = steps[:pos]
        k = open_hop(question, context)
        hop = hops[k] if k is not None else None
        stated = [s.content for s in context if s.kind == "subanswer" and s.content]
        echo = stated[-1] if stated else entity_surface(question_entity(question))
        if gold.kind == "subanswer" and hop is not None and context and context[-1].kind == "subquery":
            docs = context[-1].docs or []
            answers = _hop_answers(hop)
            searched = [entity_surface(hop.title), *stated, entity_surface(question_entity(question))]
            # names of the documents (other documents' titles too) that neither are nor echo what is known
            names = [n for d in docs for n in ([d.title] if d.title != hop.title else []) + document_names(d.text)]
            own = [_tokens(x) for x in [*answers, *searched] if x]
            names = [n for n in dict.fromkeys(names)
                     if not _covers(n, answers) and not any(_tokens(n) <= t for t in own)]
            # the hardest distractor has the answer's type: a year for a year, a name for a name
            same = [n for n in names if _is_number(n) == _is_number(hop.answer)]
            for n in same or names:
                opts["in_document_distractor"].append((pos, Step("subanswer", thought=gold.thought, content=n)))
            if echo:
                opts["previous_answer_repeated"].append((pos, Step("subanswer", thought=gold.thought, content=echo)))
            if any(j > k for j in retrieval) and final is not None:
                opts["answer_without_reading"].append((pos, Step("answer", thought=final.thought,
                                                                 content=hop.answer)))
        if gold.kind == "answer" and pos == len(steps) - 1:
            for s in dict.fromkeys(stated):
                opts["wrong_final_from_chain"].append((pos, Step("answer", thought=gold.thought, content=s)))
        if gold.kind == "subquery" and hop is not None:
            entity = entity_surface(hop.title)
            if entity and entity in gold.content:
                for near in _near_misses(entity, entities):
                    opts["partial_entity"].append((pos, Step("subquery", thought=gold.thought.replace(entity, near),
                                                             content=gold.content.replace(entity, near))))
            answers = _hop_answers(hop)
            for later in steps[pos + 1:]:
                if later.kind == "subquery" and _covers(later.content, answers):
                    opts["skipped_hop"].append((pos, Step("subquery", thought=gold.thought, content=later.content)))
                    break
    return opts


def _differs(a: Step, b: Step) -> bool:
    return a.kind != b.kind or normalize_answer(a.content) != normalize_answer(b.content)


def corrupt_held_out(question, steps: Sequence[Step], rng: random.Random, entities: Sequence[str] = (),
                     families: Sequence[str] = HELD_OUT) -> list[ProbeCase]:
    """Held-out corruptions of ``steps`` (a correct trajectory of ``question``: gold, or the agent's own), at most
    one per family, each drawn with ``rng`` among the rewrites whose gold step the judge accepts and whose
    corrupted step it rejects (and differs from the gold one).

    question: a Question with its gold decomposition (the judge needs it); steps: [Step], ending with the
    answer; entities: world entity names, where ``partial_entity`` looks for near misses (the right entity cut
    short is tried whatever they are); families: a subset of :data:`HELD_OUT`."""
    unknown = [f for f in families if f not in HELD_OUT]
    if unknown:
        raise InvalidArgument(f"unknown held-out families {unknown}; known: {', '.join(HELD_OUT)}")
    opts = _options_held_out(question, steps, entities)
    out = []
    for family in families:
        ok = [(pos, bad) for pos, bad in opts[family] if _differs(bad, steps[pos])
              and judge_step(question, steps[:pos], steps[pos]).sound
              and not judge_step(question, steps[:pos], bad).sound]
        if ok:
            pos, bad = rng.choice(ok)
            out.append(ProbeCase(question.id, question.question, family, pos, list(steps[:pos]), steps[pos], bad))
    return out


def validation_cases(questions: Sequence, trajectories: Sequence[Sequence[Step]], seed: int = 0,
                     families: Sequence[str] = FAMILIES, entities: Sequence[str] | None = None,
                     answers: Sequence[str] | None = None) -> tuple[list[ProbeCase], dict[str, int]]:
    """Every case of ``families`` over ``questions`` [N] and their correct ``trajectories`` [N] (lists of Steps:
    gold ones, or the agent's own correct ones), and per family how many built cases were dropped because the
    judge accepted the corrupted step, rejected the gold one, or the two were the same step.

    The in-distribution families draw from ``random.Random(seed)`` question by question as the pipeline's
    validation always has (the same cases for the same seed), the held-out ones from their own stream, so
    adding or removing held-out families never changes the in-distribution cases. entities / answers default
    to the questions' entities (their first hop's title) / every hop's answer."""
    if len(questions) != len(trajectories):
        raise InvalidArgument(f"{len(questions)} questions but {len(trajectories)} trajectories: give one "
                              "correct trajectory per question")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise InvalidArgument(f"unknown corruption families {unknown}; known: {', '.join(FAMILIES)}")
    if entities is None:
        entities = sorted({question_entity(q) for q in questions} - {""})
    if answers is None:
        answers = sorted({s.answer for q in questions for s in q.decomposition if s.doc_id})
    # near misses come from every entity the questions name, hop answers included ("Yxine" for "Yxine City")
    world = sorted({*entities, *(entity_surface(s.title) for q in questions for s in q.decomposition if s.title),
                    *(s.answer for q in questions for s in q.decomposition if s.answer)} - {""})
    rng_in, rng_out = random.Random(seed), random.Random(f"{seed}/held_out")
    held = [f for f in HELD_OUT if f in families]
    cases: list[ProbeCase] = []
    dropped = {f: 0 for f in families}
    for q, steps in zip(questions, trajectories):
        for c in corrupt(q, steps, rng_in, entities, answers):
            if c.kind not in families:
                continue
            if (_differs(c.corrupted, c.gold) and judge_step(q, c.context, c.gold).sound
                    and not judge_step(q, c.context, c.corrupted).sound):
                cases.append(c)
            else:
                dropped[c.kind] += 1
        if held:
            cases += corrupt_held_out(q, steps, rng_out, world, held)
    return cases, dropped


def _pooled(gold: Sequence[float], bad: Sequence[float]) -> dict:
    from prorag.algorithms.prm import auc  # its module loads torch; the corruption builders above do not

    return {"auc": auc(list(gold), list(bad)) if gold else None, "n": len(gold)}


def auc_by_kind(cases: Sequence[ProbeCase], gold_scores: Sequence[float],
                corrupted_scores: Sequence[float]) -> dict:
    """{"overall": AUC, "n": N, "by_kind": {kind: {"auc", "n"}}, "in_distribution": {"auc", "n", "kinds"},
    "held_out": {"auc", "n", "kinds"}} of gold steps (positives) against corrupted ones (negatives).

    cases [N], gold_scores [N], corrupted_scores [N]: one pair of scores per case (the gold step is shared between
    kinds at one position; it is counted once per case, as its own contrast). "overall" pools every case, of
    every family given; the two groups pool theirs (auc None, n 0 when a group has no case); "kinds" lists the
    group's families present. Kinds outside :data:`FAMILIES` are reported in by_kind after the known ones."""
    from prorag.algorithms.prm import auc  # its module loads torch; the corruption builders above do not

    if not (len(cases) == len(gold_scores) == len(corrupted_scores)):
        raise ValueError("one gold and one corrupted score per case")
    out = {"overall": auc(list(gold_scores), list(corrupted_scores)), "n": len(cases), "by_kind": {}}
    present = list(dict.fromkeys(c.kind for c in cases))
    for kind in [*[k for k in FAMILIES if k in present], *[k for k in present if k not in FAMILIES]]:
        idx = [i for i, c in enumerate(cases) if c.kind == kind]
        out["by_kind"][kind] = {"auc": auc([gold_scores[i] for i in idx], [corrupted_scores[i] for i in idx]),
                                "n": len(idx)}
    for group, kinds in (("in_distribution", CORRUPTIONS), ("held_out", HELD_OUT)):
        idx = [i for i, c in enumerate(cases) if c.kind in kinds]
        out[group] = {**_pooled([gold_scores[i] for i in idx], [corrupted_scores[i] for i in idx]),
                      "kinds": [k for k in kinds if k in out["by_kind"]]}
    return out


def centred_per_kind(cases: Sequence[ProbeCase], gold_scores: Sequence[float],
                     corrupted_scores: Sequence[float]) -> tuple[list[float], list[float], dict[str, float]]:
    """(gold [N], corrupted [N], {step kind: mean}) with each score minus the mean score of its step's kind over
    every scored step of ``cases`` [N] (gold and corrupted alike): the scores as the RL's process advantage reads
    them (prm_centering=per_kind centres within its batch). A family that compares two kinds (premature_answer:
    a subquery against an answer) then measures the steps rather than the kinds' offsets. A diagnostic beside
    :func:`auc_by_kind` on raw scores, which the gate reads.

    >>> c = [ProbeCase("q", "Q?", "premature_answer", 1, [], Step("subquery"), Step("answer"))]
    >>> centred_per_kind(c, [-2.0], [1.0])
    ([0.0], [0.0], {'subquery': -2.0, 'answer': 1.0})
    """
    if not (len(cases) == len(gold_scores) == len(corrupted_scores)):
        raise ValueError("one gold and one corrupted score per case")
    by_kind: dict[str, list[float]] = {}
    for c, g, b in zip(cases, gold_scores, corrupted_scores):
        by_kind.setdefault(c.gold.kind, []).append(g)
        by_kind.setdefault(c.corrupted.kind, []).append(b)
    means = {k: sum(v) / len(v) for k, v in by_kind.items()}
    return ([g - means[c.gold.kind] for c, g in zip(cases, gold_scores)],
            [b - means[c.corrupted.kind] for c, b in zip(cases, corrupted_scores)], means)


def prm_gate(auc_report: Mapping, min_unsupported: float = 0.8, min_overall: float = 0.9, min_cases: int = 20,
             unsupported_families: Sequence[str] = UNSUPPORTED_FAMILIES) -> tuple[bool, list[str]]:
    """Whether a PRM may guide a stage (RFT's filter, RL's process term): (passed, reasons it failed; [] when
    passed), read off :func:`auc_by_kind`'s report of a validation on dev.

    Passes when each of ``unsupported_families`` has at least ``min_cases`` cases and AUC >= ``min_unsupported``
    (an unsupported sub-answer: absent from the documents, or in them but not the answer: both are reading
    failures, and the second is the one a lookup cannot catch), the held-out families are present (without them
    a high AUC may mean the generator, not the PRM), and the AUC over every family is >= ``min_overall``."""
    if not 0.0 <= min_unsupported <= 1.0 or not 0.0 <= min_overall <= 1.0:
        raise InvalidArgument(f"AUC thresholds are in [0, 1]; got min_unsupported={min_unsupported}, "
                              f"min_overall={min_overall}")
    if min_cases < 1:
        raise InvalidArgument(f"min_cases is at least 1 (an AUC needs a case); got {min_cases}")
    if not isinstance(auc_report, Mapping) or "overall" not in auc_report or "by_kind" not in auc_report:
        raise InvalidArgument("prm_gate reads prorag.prm.evaluation.auc_by_kind's report ({'overall', 'by_kind', "
                              "...}); "
                              f"got {type(auc_report).__name__} with keys "
                              f"{sorted(auc_report) if isinstance(auc_report, Mapping) else '-'}")
    reasons = []
    by_kind = auc_report["by_kind"]
    for family in unsupported_families:
        v = by_kind.get(family)
        if not v or not v.get("n"):
            reasons.append(f"no {family} cases: validate with prorag.prm.evaluation.validation_cases, which builds it")
        elif v["n"] < min_cases:
            reasons.append(f"{family}: {v['n']} cases, fewer than {min_cases}: validate on more dev questions")
        elif v["auc"] < min_unsupported:
            reasons.append(f"{family} AUC {v['auc']:.3f} < {min_unsupported} (n={v['n']}): the PRM does not tell "
                           "a sub-answer the documents support from one they do not")
    held = [k for k in HELD_OUT if by_kind.get(k, {}).get("n")]
    if not held:
        reasons.append("no held-out family was validated: the overall AUC then measures the corruption generator "
                       "as much as the PRM; validate with prorag.prm.evaluation.validation_cases")
    overall = auc_report["overall"]
    if overall is None or overall < min_overall:
        shown = "-" if overall is None else f"{overall:.3f}"
        reasons.append(f"overall AUC {shown} < {min_overall} (n={auc_report.get('n', '-')}, every family)")
    return not reasons, reasons


__all__ = ["CORRUPTIONS", "FAMILIES", "HELD_OUT", "ProbeCase", "UNSUPPORTED_FAMILIES", "auc_by_kind",
           "centred_per_kind", "corrupt", "corrupt_held_out", "document_names", "entity_surface", "prm_gate",
           "validation_cases"]
