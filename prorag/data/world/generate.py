"""The world in memory: its entity graph, one document per entity, and question splits disjoint by chain and text."""

from __future__ import annotations

import random
from collections import Counter
from typing import Callable

from prorag.data.loaders import format_contents
from prorag.data.world.config import CATEGORIES, DEEP_SPLIT, DEV_DEEP_SPLIT, MIXED_SPLITS, SPLITS, WorldConfig
from prorag.data.world.documents import document
from prorag.data.world.graph import EntityGraph
from prorag.data.world.questions import QuestionMaker


def generate_world(cfg: WorldConfig, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Generate everything in memory: ``{"docs", "splits", "entities", "relations"}``."""
    return _generate(cfg, progress)[0]


def generate_deep_split(cfg: WorldConfig, n: int, min_hops: int = 3, dev: int = 0
                        ) -> tuple[dict, list[dict]] | tuple[dict, list[dict], list[dict]]:
    """(the world as :func:`generate_world` makes it, ``n`` more compositional questions of ``min_hops``+ hops),
    and with ``dev`` > 0 also ``dev`` questions for the dev side (:data:`DEV_DEEP_SPLIT`).

    The extra questions are drawn after train, from the generator's state there, never repeating a chain or a
    question of any split, so the world's own splits are unchanged by asking for them: an evaluation split
    with enough deep questions to tell methods apart (issue 19: 600 of 3+ hops) added to a world already built
    and trained on. Hop counts follow the config's mix of the deep ones (3-hop : 4-hop = frac_3hop : frac_4hop).
    The dev questions are drawn after the ``n`` test ones, so those are the same with or without them, and no
    chain or question is shared between the two.
    """
    sizes = [(DEEP_SPLIT, n)] + ([(DEV_DEEP_SPLIT, dev)] if dev else [])
    w, drawn = generate_drawn_splits(cfg, sizes, min_hops)
    return (w, *drawn.values())


def generate_drawn_splits(cfg: WorldConfig, sizes: list[tuple[str, int]], min_hops: int = 3
                          ) -> tuple[dict, dict[str, list[dict]]]:
    """(the world, {split name: its questions}) for extra splits drawn one after another in the order of ``sizes``
    [(name, count)], after train: each split is the same whatever is drawn after it, and no chain or question is
    shared with any split before it (the world's own included). A split is of ``min_hops``+ hop compositional
    questions, unless it is one of :data:`MIXED_SPLITS`, whose questions follow the config's category mix as the
    world's own splits do. :func:`generate_deep_split` is its test / dev case; the held-out split
    (:data:`HELDOUT_DEEP_SPLIT`) comes third, after both."""
    w, questions, seen_chains, seen_text = _generate(cfg, None)
    hops = [h for h in (3, 4) if h >= min_hops]
    weights = [{3: cfg.frac_3hop, 4: cfg.frac_4hop}[h] for h in hops]

    def draw_deep(count: int, name: str) -> list[dict]:
        rows: list[dict] = []
        for h, target in zip(hops, _split_counts(count, weights)):
            made, tries = 0, 0
            while made < target and tries < 60 * target + 500:
                tries += 1
                q = questions.compositional(h)
                if q is None or q["chain"] in seen_chains or q["question"] in seen_text:
                    continue
                seen_chains.add(q["chain"])
                seen_text.add(q["question"])
                rows.append(q)
                made += 1
        questions.rng.shuffle(rows)
        return [_row(name, i, q) for i, q in enumerate(rows)]

    return w, {name: (_draw_mixed(questions, name, count, cfg.mix(), seen_chains, seen_text)
                      if name in MIXED_SPLITS else draw_deep(count, name)) for name, count in sizes}


def _draw_mixed(questions: QuestionMaker, name: str, count: int, mix: dict[str, float], seen_chains: set[str],
                seen_text: set[str]) -> list[dict]:
    """``count`` questions split over :data:`CATEGORIES` by ``mix``, yes/no answers of comparisons balanced, none
    repeating a chain or question already seen (both sets updated), shuffled, as rows ``{name}_{i}``. A category
    whose chains run out gives fewer."""
    rows: list[dict] = []
    for cat, target in zip(CATEGORIES, _split_counts(count, [mix[c] for c in CATEGORIES])):
        made, tries = 0, 0
        yes_no = Counter()
        while made < target and tries < 60 * target + 500:
            tries += 1
            q = questions.make(cat, want_yes=yes_no["yes"] <= yes_no["no"])
            if q is None or q["chain"] in seen_chains or q["question"] in seen_text:
                continue
            seen_chains.add(q["chain"])
            seen_text.add(q["question"])
            rows.append(q)
            yes_no[q["golden_answers"][0]] += 1
            made += 1
    questions.rng.shuffle(rows)
    return [_row(name, i, q) for i, q in enumerate(rows)]


def _generate(cfg: WorldConfig, progress: Callable[[str, int, int], None] | None):
    """generate_world's output, and the question maker and what it has used, for :func:`generate_deep_split`."""
    counts = cfg.resolved()
    # One stream draws the graph, then the documents, then the questions: the order of the draws is the world.
    rng = random.Random(cfg.seed)
    graph = EntityGraph(cfg, counts["entities"], rng)
    questions = QuestionMaker(graph, rng)
    report = progress or (lambda stage, done, total: None)
    ents = sorted(graph.ents.values(), key=lambda e: e.id)
    report("entities", len(ents), len(ents))

    docs = []
    for e in ents:
        docs.append({"id": e.id, "contents": format_contents(e.title, document(e, graph, rng, cfg.max_filler))})
        if len(docs) % 2000 == 0:
            report("documents", len(docs), len(ents))
    report("documents", len(docs), len(ents))

    seen_chains: set[str] = set()
    seen_text: set[str] = set()
    splits: dict[str, list[dict]] = {}
    mix = cfg.mix()
    # evaluation splits first, so a small world fills them before train takes what is left
    for split in ("test", "dev", "train"):
        splits[split] = _draw_mixed(questions, split, counts[split], mix, seen_chains, seen_text)
        report(f"questions {split}", len(splits[split]), counts[split])

    entities = [{"id": e.id, "type": e.type, "kind": e.kind, "name": e.name, "title": e.title,
                 "shared_name": e.shared, "attrs": e.attrs, "rels": e.rels} for e in ents]
    relations = [[e.id, r, t] for e in ents for r, t in sorted(e.rels.items())]
    return ({"docs": docs, "splits": {s: splits[s] for s in SPLITS}, "entities": entities, "relations": relations},
            questions, seen_chains, seen_text)


def _row(split: str, i: int, q: dict) -> dict:
    sup = list(dict.fromkeys(s["doc_id"] for s in q["steps"] if s["doc_id"]))
    return {"id": f"{split}_{i}", "question": q["question"], "golden_answers": list(q["golden_answers"]),
            "metadata": {"type": q["type"], "hops": q["hops"], "decomposition": q["steps"],
                         "supporting_doc_ids": sup, "chain": q["chain"]}}


def _split_counts(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder rounding of ``total`` into shares proportional to ``weights``."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out
