"""Questions over the entity graph, each with its gold decomposition, and the phrasings they are written in.

A question is compositional (a walk of 1-4 hops along relations, the earlier hops folded into noun phrases), a
comparison (one fact of each of two entities) or a bridge comparison (one fact of the entities two works or
organisations lead to). Its decomposition has one sub-question per hop that names the previous hop's answer, and a
final reasoning step (``doc_id == ""``) for the comparisons.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from prorag.data.world.graph import Entity, EntityGraph
from prorag.data.world.names import cap


class QuestionMaker:
    """Candidate questions drawn from ``graph``; the caller rejects the ones a split already has."""

    def __init__(self, graph: EntityGraph, rng: random.Random):
        self.graph = graph
        self.rng = rng

    def _step(self, e: Entity, rel: str) -> dict:
        """One gold sub-step: a direct question naming ``e`` (qualified if its name is shared)."""
        ans, aliases = self.graph.answer_of(self.graph.value(e, rel), rel)
        q = cap(self.rng.choice(_qtemplates(rel, e, nested=False)).format(x=e.mention()))
        return {"question": q, "answer": ans, "answer_aliases": aliases, "doc_id": e.id, "title": e.title}

    def _walk(self, hops: int) -> tuple[list[Entity], list[str]] | None:
        rng = self.rng
        pool = self.graph.by_type[rng.choice(["work", "work", "person", "person", "org", "city", "country"])]
        e = rng.choice(pool)
        nodes, rels, seen = [], [], {e.id}
        for i in range(hops):
            last = i == hops - 1
            ent = [r for r in self.graph.entity_rels(e) if e.rels[r] not in seen]
            lits = self.graph.literal_rels(e) if last else []
            opts = ent + lits
            if ent and lits:
                # about half the answers are literals (years, jobs); continents only a quarter, as few exist
                opts = lits if rng.random() < (0.25 if e.type == "country" else 0.5) else ent
            if not opts:
                return None
            r = rng.choice(opts)
            nodes.append(e)
            rels.append(r)
            if not last:
                e = self.graph.value(e, r)
                seen.add(e.id)
        return nodes, rels

    def compositional(self, hops: int) -> dict | None:
        walk = self._walk(hops)
        if walk is None:
            return None
        nodes, rels = walk
        steps = [self._step(e, r) for e, r in zip(nodes, rels)]
        x = nodes[0].mention()
        for e, r in zip(nodes[:-1], rels[:-1]):
            x = self.rng.choice(_NP[r] if isinstance(_NP[r], list) else _NP[r][e.kind]).format(x=x)
        q = cap(self.rng.choice(_qtemplates(rels[-1], nodes[-1], nested=hops > 1)).format(x=x))
        return {"question": q, "golden_answers": steps[-1]["answer_aliases"], "type": "compositional", "hops": hops,
                "steps": steps, "chain": _chain(nodes, rels)}

    def _pair(self, draw: Callable[[], tuple[Entity, Entity] | None], tries: int = 30):
        """Retry ``draw`` until it yields a usable pair (names told apart), else None."""
        key = self.graph.key
        for _ in range(tries):
            pair = draw()
            if pair is not None and pair[0].id != pair[1].id and key[pair[0].id] != key[pair[1].id]:
                return pair
        return None

    def comparison(self, want_yes: bool) -> dict | None:
        rng = self.rng
        kind = rng.choice(["born", "born", "founded", "released", "same_country", "same_birth_city", "same_hq"])
        if kind in ("born", "founded", "released"):
            etype, rel = {"born": ("person", "birth_year"), "founded": ("org", "founded_year"),
                          "released": ("work", "release_year")}[kind]
            pool = self.graph.by_type[etype]

            def draw():
                a, b = rng.sample(pool, 2)
                return (a, b) if self.graph.value(a, rel) != self.graph.value(b, rel) else None
            pair = self._pair(draw)
            if pair is None:
                return None
            a, b = pair
            earlier = rng.random() < 0.6
            q = cap(rng.choice(_CMP[kind][earlier]).format(a=a.mention(), b=b.mention()))
            win = a if (self.graph.value(a, rel) < self.graph.value(b, rel)) == earlier else b
            golden = win.aliases()
        else:
            etype, rel = {"same_country": ("city", "country"), "same_birth_city": ("person", "birth_city"),
                          "same_hq": ("org", "headquarters")}[kind]
            pool, groups = self.graph.by_type[etype], self.graph.groups[(etype, rel)]
            # "yes" pairs come from a group sharing the value; the caller alternates so yes/no stay balanced
            if want_yes and not self.graph.pairable[(etype, rel)]:
                return None

            def draw():
                if want_yes:
                    a = rng.choice(self.graph.pairable[(etype, rel)])
                    return a, rng.choice(groups[a.rels[rel]])
                a, b = rng.sample(pool, 2)
                return (a, b) if a.rels[rel] != b.rels[rel] else None
            pair = self._pair(draw)
            if pair is None:
                return None
            a, b = pair
            q = cap(rng.choice(_CMP[kind]).format(a=a.mention(), b=b.mention()))
            golden = ["yes" if want_yes else "no"]
        steps = [self._step(a, rel), self._step(b, rel),
                 {"question": q, "answer": golden[0], "answer_aliases": golden, "doc_id": "", "title": ""}]
        chain = "&".join(sorted([_chain([a], [rel]), _chain([b], [rel])]))
        return {"question": q, "golden_answers": golden, "type": "comparison", "hops": 2, "steps": steps,
                "chain": chain}

    def bridge_comparison(self, want_yes: bool) -> dict | None:
        rng = self.rng
        kind = rng.choice(["creator_born", "creator_born", "founder_born", "creator_same_city"])
        if kind == "founder_born":
            bridge_rel, pool, noun = "founder", self.graph.by_type["org"], None
        else:
            noun = rng.choice(["film", "novel", "album"])
            bridge_rel, pool = "creator", self.graph.works_of_kind[noun]
        if len(pool) < 2:
            return None

        def draw():
            a, b = rng.sample(pool, 2)
            if kind == "creator_same_city" and want_yes:
                city = self.graph.value(a, "creator").rels["birth_city"]
                b = rng.choice(self.graph.works_by_creator_city[(a.kind, city)])
            ma, mb = self.graph.value(a, bridge_rel), self.graph.value(b, bridge_rel)
            if ma.id == mb.id:
                return None
            if kind == "creator_same_city":
                return (a, b) if (ma.rels["birth_city"] == mb.rels["birth_city"]) == want_yes else None
            return (a, b) if ma.attrs["birth_year"] != mb.attrs["birth_year"] else None
        pair = self._pair(draw)
        if pair is None:
            return None
        a, b = pair
        ma, mb = self.graph.value(a, bridge_rel), self.graph.value(b, bridge_rel)
        fmt = {"a": a.mention(), "b": b.mention(), "k": noun or "", "r": _ROLE.get(noun or "", "")}
        if kind == "creator_same_city":
            rel = "birth_city"
            q = cap(rng.choice(_BRIDGE["same_city"]).format(**fmt))
            golden = ["yes" if want_yes else "no"]
        else:
            rel = "birth_year"
            ya, yb = ma.attrs["birth_year"], mb.attrs["birth_year"]
            earlier = rng.random() < 0.6
            key = "creator" if kind == "creator_born" else "founder"
            q = cap(rng.choice(_BRIDGE[key][earlier]).format(**fmt))
            golden = (a if (ya < yb) == earlier else b).aliases()
        steps = [self._step(a, bridge_rel), self._step(b, bridge_rel), self._step(ma, rel), self._step(mb, rel),
                 {"question": q, "answer": golden[0], "answer_aliases": golden, "doc_id": "", "title": ""}]
        chain = "&".join(sorted([_chain([a, ma], [bridge_rel, rel]), _chain([b, mb], [bridge_rel, rel])]))
        return {"question": q, "golden_answers": golden, "type": "bridge_comparison", "hops": 4, "steps": steps,
                "chain": chain}

    def make(self, category: str, want_yes: bool = True) -> dict | None:
        """One candidate question of ``category``; ``want_yes`` picks the answer of a yes/no comparison."""
        if category.endswith("hop"):
            return self.compositional(int(category[0]))
        if category == "comparison":
            return self.comparison(want_yes)
        return self.bridge_comparison(want_yes)


def _chain(nodes: list[Entity], rels: list[str]) -> str:
    return ">".join(f"{e.id}.{r}" for e, r in zip(nodes, rels))


# ============================================================================ phrasings

# direct questions: {x} names the subject (an entity mention, or a noun phrase when nested)
_Q: dict[str, Any] = {
    "birth_city": ["Where was {x} born?", "In which city was {x} born?", "What is the birthplace of {x}?"],
    "birth_year": ["When was {x} born?", "In what year was {x} born?", "What year was {x} born in?"],
    "occupation": ["What was the occupation of {x}?", "What did {x} do for a living?", "What was {x}'s profession?"],
    "employer": ["For which organisation did {x} work?", "Who employed {x}?", "Which organisation employed {x}?"],
    "spouse": ["Who was {x} married to?", "Who was the spouse of {x}?", "Whom did {x} marry?"],
    "creator": {"film": ["Who directed {x}?", "Who was the director of {x}?", "Who is the director of {x}?"],
                "novel": ["Who wrote {x}?", "Who is the author of {x}?", "Who was {x} written by?"],
                "album": ["Who recorded {x}?", "Which artist recorded {x}?", "Who is the artist behind {x}?"]},
    "release_year": {"film": ["When was {x} released?", "In what year was {x} released?",
                              "What year did {x} premiere?"],
                     "novel": ["When was {x} published?", "In what year was {x} published?",
                               "What year did {x} first appear in print?"],
                     "album": ["When was {x} released?", "In what year did {x} come out?",
                               "What year was {x} released in?"]},
    "publisher": {"film": ["Which studio produced {x}?", "Who produced {x}?", "What studio was behind {x}?"],
                  "novel": ["Who published {x}?", "Which publisher released {x}?", "What company published {x}?"],
                  "album": ["Which label released {x}?", "On which record label was {x} released?",
                            "What label put out {x}?"]},
    "founded_year": ["When was {x} founded?", "In what year was {x} established?", "What year was {x} founded in?"],
    "founder": ["Who founded {x}?", "Who was the founder of {x}?", "Who established {x}?"],
    "headquarters": ["In which city is {x} based?", "Where is {x} based?", "Which city is {x} based in?"],
    "country": ["In which country is {x}?", "Which country is {x} located in?", "{x} is in which country?"],
    "capital": ["What is the capital of {x}?", "Which city is the capital of {x}?", "What is {x}'s capital?"],
    "leader": ["Who is the head of state of {x}?", "Who leads {x}?", "Who is {x}'s head of state?"],
    "continent": ["On which continent is {x}?", "Which continent is {x} on?", "{x} lies on which continent?"],
}

# noun phrases that stand for an intermediate hop inside a composed question
_NP: dict[str, Any] = {
    "birth_city": ["the birthplace of {x}", "the city where {x} was born", "the home town of {x}"],
    "employer": ["the employer of {x}", "the organisation for which {x} worked", "the organisation that employed {x}"],
    "spouse": ["the spouse of {x}", "the person whom {x} married", "the person married to {x}"],
    "creator": {"film": ["the director of {x}", "the person who directed {x}", "the filmmaker behind {x}"],
                "novel": ["the author of {x}", "the writer of {x}", "the person who wrote {x}"],
                "album": ["the artist who recorded {x}", "the performer of {x}", "the musician behind {x}"]},
    "publisher": {"film": ["the studio that produced {x}", "the producer of {x}", "the studio behind {x}"],
                  "novel": ["the publisher of {x}", "the company that published {x}", "the publishing house of {x}"],
                  "album": ["the label that released {x}", "the record label of {x}", "the label behind {x}"]},
    "founder": ["the founder of {x}", "the person who founded {x}", "the person who established {x}"],
    "headquarters": ["the city where {x} is based", "the home city of {x}", "the base city of {x}"],
    "country": ["the country of {x}", "the country containing {x}", "the country that contains {x}"],
    "capital": ["the capital of {x}", "the capital city of {x}", "the seat of government of {x}"],
    "leader": ["the head of state of {x}", "the leader of {x}", "the person who leads {x}"],
}


def _qtemplates(rel: str, e: Entity, nested: bool) -> list[str]:
    t = _Q[rel]
    if isinstance(t, dict):
        t = t[e.kind]
    if nested:  # "the director of X's profession" reads badly: no possessives on noun phrases
        t = [x for x in t if "{x}'s" not in x]
    return t


def _direct_phrasings() -> list[tuple[re.Pattern, str]]:
    """(pattern of one phrasing of a direct question, that relation's first phrasing) for every phrasing."""
    out = []
    for rel, table in _Q.items():
        for group in (table.values() if isinstance(table, dict) else [table]):
            for tmpl in group:
                head, tail = tmpl.split("{x}")
                out.append((re.compile(re.escape(head) + "(?P<x>.+)" + re.escape(tail)), group[0]))
    return out


_DIRECT_PHRASINGS = _direct_phrasings()


def canonical_question(question: str) -> str:
    """The same direct question in its relation's first phrasing ("Who established X?" -> "Who founded
    X?"); the question unchanged when it is none of this world's phrasings, or could be two relations.

    Why: the world draws each sub-question's phrasing at random, and a policy trained to write those
    subqueries learns a mixture; a 3M-parameter one blends the templates into malformed subqueries
    (docs/BENCHMARKS.md). One phrasing per relation is what an LLM rewriting the trajectories tends to
    write anyway.
    """
    found = set()
    for pattern, first in _DIRECT_PHRASINGS:
        m = pattern.fullmatch(question)
        if m:
            # a qualified mention opening the question was capitalised ("The city of X is in ...")
            x = re.sub(r"^The (?=[a-z])", "the ", m.group("x")) if m.start("x") == 0 else m.group("x")
            found.add(cap(first.format(x=x)))
    return found.pop() if len(found) == 1 else question


# the maker of each kind of work, as a bridge comparison names them
_ROLE = {"film": "director", "novel": "author", "album": "artist"}

_CMP: dict[str, Any] = {
    "born": {True: ["Who was born first, {a} or {b}?", "Which of {a} and {b} was born earlier?",
                    "Who is older, {a} or {b}?"],
             False: ["Who was born later, {a} or {b}?", "Which of {a} and {b} was born more recently?",
                     "Who is younger, {a} or {b}?"]},
    "founded": {True: ["Which was founded first, {a} or {b}?", "Which is older, {a} or {b}?",
                       "Which was established earlier, {a} or {b}?"],
                False: ["Which was founded later, {a} or {b}?", "Which is younger, {a} or {b}?",
                        "Which was established more recently, {a} or {b}?"]},
    "released": {True: ["Which came out first, {a} or {b}?", "Which was released earlier, {a} or {b}?",
                        "Which is older, {a} or {b}?"],
                 False: ["Which came out later, {a} or {b}?", "Which was released more recently, {a} or {b}?",
                         "Which is newer, {a} or {b}?"]},
    "same_country": ["Are {a} and {b} located in the same country?", "Are {a} and {b} in the same country?",
                     "Do {a} and {b} lie in the same country?"],
    "same_birth_city": ["Were {a} and {b} born in the same city?", "Do {a} and {b} share a birthplace?",
                        "Were {a} and {b} born in the same place?"],
    "same_hq": ["Are {a} and {b} based in the same city?", "Do {a} and {b} have their base in the same city?",
                "Are {a} and {b} located in the same city?"],
}

_BRIDGE: dict[str, Any] = {
    "creator": {True: ["Which {k} has the {r} who was born first, {a} or {b}?",
                       "Which {k} was made by the older {r}, {a} or {b}?",
                       "Whose {r} was born earlier, {a} or {b}?"],
                False: ["Which {k} has the {r} who was born later, {a} or {b}?",
                        "Which {k} was made by the younger {r}, {a} or {b}?",
                        "Whose {r} was born more recently, {a} or {b}?"]},
    "founder": {True: ["Which organisation has the founder who was born first, {a} or {b}?",
                       "Whose founder was born earlier, {a} or {b}?",
                       "Which was founded by the older person, {a} or {b}?"],
                False: ["Which organisation has the founder who was born later, {a} or {b}?",
                        "Whose founder was born more recently, {a} or {b}?",
                        "Which was founded by the younger person, {a} or {b}?"]},
    "same_city": ["Were the {r}s of {a} and {b} born in the same city?",
                  "Do the {r}s of {a} and {b} share a birthplace?",
                  "Were the {r} of {a} and the {r} of {b} born in the same place?"],
}

