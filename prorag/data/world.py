"""A deterministic, embedded multi-hop QA benchmark: an invented world, its corpus and questions.

``prorag world --name NAME --seed S --size SIZE`` calls :func:`build_world`. Everything is
drawn from ``random.Random(seed)`` (never the global generator, never ``hash()`` of a
string, sets only iterated sorted), so the same seed and config give byte-identical files.

The world is a typed entity graph (persons, cities, countries, organisations, works)
whose functional relations chain up to four hops, e.g. work -> creator -> birth city ->
country -> continent. Each entity gets one wiki-style document that states its relations
in one of several phrasings; some entities deliberately share a (normalised) name with
another of a different kind, so the title carries a disambiguator ("Marlo Vesk (painter)")
and questions name such entities with their kind ("the painter Marlo Vesk").

Questions (FlashRAG rows) come with a gold decomposition: one sub-question per hop that
names the previous hop's answer, its answer and aliases, and the supporting document.
A step with ``doc_id == ""`` is a reasoning step (the final comparison) that needs no
retrieval. Splits are disjoint by ``metadata.chain`` (the (entity, relation) edges a
question traverses) and by question text.

Output files (all written atomically, ``DONE`` last)::

    corpus.jsonl   {"id", "contents": "\\"Title\\"\\ntext"}
    train.jsonl    {"id", "question", "golden_answers", "metadata": {"type", "hops",
    dev.jsonl         "decomposition": [{"question", "answer", "answer_aliases", "doc_id", "title"}],
    test.jsonl        "supporting_doc_ids", "chain"}}
    world.json     config, seed, version, counts, entities, relations
    DONE           written last; a folder without it is a partial build and is rebuilt
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prorag.config import ConfigError, cfg_field, from_dict, to_dict
from prorag.data.loaders import format_contents
from prorag.io import read_jsonl, write_json, write_jsonl, write_text
from prorag.metrics import normalize_answer

__all__ = ["WORLD_VERSION", "SIZES", "DEEP_SPLIT", "DEEP_SPLITS", "DEV_DEEP_SPLIT", "WorldConfig", "WorldSummary", "build_world", "ensure_deep_split",
           "generate_deep_split", "generate_world", "load_summary"]

#: bump when the generator changes so old folders are rebuilt rather than reused
WORLD_VERSION = 1

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"entities": 150, "train": 300, "dev": 60, "test": 60},
    "small": {"entities": 600, "train": 1500, "dev": 200, "test": 200},
    "default": {"entities": 2500, "train": 8000, "dev": 500, "test": 500},
    "large": {"entities": 20000, "train": 40000, "dev": 1000, "test": 1000},
}

CATEGORIES = ("1hop", "2hop", "3hop", "4hop", "comparison", "bridge_comparison")
SPLITS = ("train", "dev", "test")
#: an extra evaluation split of 3+ hop questions only, drawn after train (generate_deep_split)
DEEP_SPLIT = "test_deep"
#: its counterpart for choosing settings on dev, drawn after the test one and disjoint from it
DEV_DEEP_SPLIT = "dev_deep"
#: the deep split of each evaluation split
DEEP_SPLITS = {"test": DEEP_SPLIT, "dev": DEV_DEEP_SPLIT}


@dataclass
class WorldConfig:
    name: str = cfg_field("default", help="world name (folder under data/worlds); recorded in world.json")
    seed: int = cfg_field(0, help="random seed; same seed and config give byte-identical files", min=0)
    size: str = cfg_field("default", help="size preset: entity and question counts", choices=tuple(SIZES))
    n_entities: int = cfg_field(0, help="number of entities (= documents); 0 takes the size preset", min=0)
    n_train: int = cfg_field(0, help="train questions; 0 takes the size preset", min=0)
    n_dev: int = cfg_field(0, help="dev questions; 0 takes the size preset", min=0)
    n_test: int = cfg_field(0, help="test questions; 0 takes the size preset", min=0)
    frac_1hop: float = cfg_field(0.25, help="share of 1-hop compositional questions per split", min=0, max=1)
    frac_2hop: float = cfg_field(0.30, help="share of 2-hop compositional questions per split", min=0, max=1)
    frac_3hop: float = cfg_field(0.20, help="share of 3-hop compositional questions per split", min=0, max=1)
    frac_4hop: float = cfg_field(0.10, help="share of 4-hop compositional questions per split", min=0, max=1)
    frac_comparison: float = cfg_field(0.10, help="share of comparison questions (two entities, one fact each)",
                                       min=0, max=1)
    frac_bridge_comparison: float = cfg_field(0.05, help="share of bridge-comparison questions (compare facts "
                                              "of the entities two works/organisations lead to)", min=0, max=1)
    shared_name_frac: float = cfg_field(0.08, help="share of entities renamed to clash with another entity's "
                                        "name (confusable distractors)", min=0, max=0.5)
    max_filler: int = cfg_field(2, help="at most this many filler sentences per document", min=0, max=6)

    def validate(self) -> None:
        if sum(self.mix().values()) <= 0:
            raise ConfigError("frac_1hop", "all question-type fractions are zero")
        if self.n_entities and self.n_entities < 60:
            raise ConfigError("n_entities", f"must be 0 (preset) or >= 60, got {self.n_entities}")

    def mix(self) -> dict[str, float]:
        return {"1hop": self.frac_1hop, "2hop": self.frac_2hop, "3hop": self.frac_3hop, "4hop": self.frac_4hop,
                "comparison": self.frac_comparison, "bridge_comparison": self.frac_bridge_comparison}

    def resolved(self) -> dict[str, int]:
        """Entity and per-split question counts after applying the size preset."""
        p = SIZES[self.size]
        return {"entities": self.n_entities or p["entities"], "train": self.n_train or p["train"],
                "dev": self.n_dev or p["dev"], "test": self.n_test or p["test"]}


@dataclass
class WorldSummary:
    name: str
    seed: int
    size: str
    out_dir: str
    n_entities: int
    n_docs: int
    splits: dict[str, int]
    by_type: dict[str, dict[str, int]]
    by_hops: dict[str, dict[str, int]]
    paths: dict[str, str]
    seconds: float
    reused: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ============================================================================ vocabulary
# Everything here is invented or generic English so no fact is about a real entity.

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "w", "z", "th", "sh", "j", "kr", "fl"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "a", "e", "ai", "ea", "y"]
_MID_CODAS = ["n", "r", "l", "s", "m"]  # a closed inner syllable: Tor-van, Kes-sa-ro
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "nd", "rn", "st", "th", "x", "sk", "ld", "rk"]
_SURNAME_END = ["", "", "", "by", "son", "ard", "ell", "wick", "ley", "mont", "stad"]
_CITY_END = ["", "", "", "", "mouth", "ford", "holm", "burg", "ton", "vale", "wick", "haven"]
_CITY_PRE = ["Port ", "Upper ", "East ", "West ", "Old "]
_COUNTRY_END = ["ia", "a", "or", "and", "ar", "ine", "", "", "istan"]
_COUNTRY_FORMS = ["Republic", "Kingdom", "Federation", "Commonwealth", "Principality", "Grand Duchy"]
_CONTINENT_END = ["ia", "a", "ea"]

_ADJ = ["Red", "Silent", "Hollow", "Golden", "Last", "Broken", "Northern", "Winter", "Quiet", "Burning",
        "Distant", "Iron", "Paper", "Glass", "Crimson", "Lonely", "Secret", "Endless", "Pale", "Wild", "Bitter",
        "Velvet", "Silver", "Drowned", "Sleeping", "Forgotten", "Bright", "Shallow", "Wandering", "Hidden",
        "Amber", "Falling", "Little", "Savage", "Gentle", "Restless", "Scarlet", "Frozen", "Open", "Narrow"]
_NOUN = ["Harbour", "Garden", "River", "Lantern", "Crown", "Mirror", "Orchard", "Tide", "Bridge", "Meadow",
         "Tower", "Letter", "Island", "Season", "Kingdom", "Engine", "Compass", "Window", "Shore", "Forest",
         "Carnival", "Voyage", "Station", "Feather", "Harvest", "Signal", "Horizon", "Archive", "Fountain",
         "Summer", "Storm", "Ember", "Valley", "Citadel", "Echo", "Orbit", "Ledger", "Canyon", "Parade", "Hymn"]

_CREATOR_OCCS = {"film": ["film director"], "novel": ["novelist", "writer"], "album": ["singer", "composer"]}
_OTHER_OCCS = ["painter", "footballer", "architect", "engineer", "chemist", "historian", "physicist", "politician",
               "entrepreneur", "actor", "banker", "sculptor"]
_OCC_ALIASES = {"film director": ["director", "filmmaker"], "novelist": ["writer", "author"],
                "writer": ["author"], "singer": ["vocalist"], "footballer": ["football player", "soccer player"],
                "entrepreneur": ["businessperson"], "composer": ["musician"]}
# which kind of organisation employs which occupation (None: any company)
_EMPLOYER = {"footballer": ("club", None), "chemist": ("university", None), "historian": ("university", None),
             "physicist": ("university", None), "film director": ("company", "film studio"),
             "actor": ("company", "film studio"), "novelist": ("company", "publishing house"),
             "writer": ("company", "publishing house"), "singer": ("company", "record label"),
             "composer": ("company", "record label")}
_PUBLISHER_INDUSTRY = {"film": "film studio", "novel": "publishing house", "album": "record label"}
_OTHER_INDUSTRIES = ["engineering firm", "bank", "shipping company", "brewery", "textile manufacturer",
                     "software company", "construction company"]
_INDUSTRY_SUFFIX = {"film studio": ["Pictures", "Studios", "Films"], "publishing house": ["Press", "Books", "House"],
                    "record label": ["Records", "Music", "Sound"], "engineering firm": ["Engineering", "Works"],
                    "bank": ["Bank", "Savings"], "shipping company": ["Shipping", "Lines"],
                    "brewery": ["Brewery", "Breweries"], "textile manufacturer": ["Textiles", "Mills"],
                    "software company": ["Systems", "Software"], "construction company": ["Construction", "Builders"]}
_ROLE = {"film": "director", "novel": "author", "album": "artist"}
_NO_NAME_TOKENS = {"a", "an", "the", "yes", "no", "noanswer"}

# relations: name -> does it point to an entity (else a literal attribute)
ENTITY_RELS = ("creator", "publisher", "birth_city", "employer", "spouse", "founder", "headquarters",
               "country", "capital", "leader")
LITERAL_RELS = ("release_year", "birth_year", "occupation", "founded_year", "continent")


# ============================================================================ entities

@dataclass
class Entity:
    id: str
    type: str  # person | city | country | org | work
    kind: str  # occupation / city / country / company|university|club / film|novel|album
    name: str
    attrs: dict[str, Any] = field(default_factory=dict)
    rels: dict[str, str] = field(default_factory=dict)
    title: str = ""
    shared: bool = False  # name clashes with another entity: qualify every mention

    @property
    def qualifier(self) -> str:
        """What tells this entity apart from a namesake: used in titles and mentions."""
        if self.type == "org":
            return self.attrs.get("industry") or ("football club" if self.kind == "club" else self.kind)
        return self.kind

    def mention(self) -> str:
        """How other documents and questions refer to it: bare name unless the name is shared."""
        if not self.shared:
            return self.name
        if self.type == "city":
            return f"the city of {self.name}"
        return f"the {self.qualifier} {self.name}"

    def aliases(self) -> list[str]:
        out = [self.name, self.title]
        if self.type == "country":
            out.append(self.attrs["official_name"])
        return list(dict.fromkeys(a for a in out if a))


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


_A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[AEIOUaeiou])")


def _articles(s: str) -> str:
    """'a engineer' -> 'an engineer' (templates write 'a {occupation}')."""
    return _A_BEFORE_VOWEL.sub(r"\1n ", s)


class _Names:
    """Pronounceable invented names, unique by normalised form unless deliberately shared."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, n_syl: int) -> str:
        rng = self.rng
        parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n_syl)]
        if rng.random() < 0.2:  # some names open on a vowel
            parts[0] = rng.choice(_VOWELS)
        for i in range(n_syl - 1):
            if rng.random() < 0.35:
                parts[i] += rng.choice(_MID_CODAS)
        parts[-1] += rng.choice(_CODAS)
        w = "".join(parts)
        return w[:1].upper() + w[1:]

    def take(self, make: Callable[[], str]) -> str:
        for _ in range(200):
            name = make()
            key = normalize_answer(name)
            toks = key.split()
            if (key and key not in self.used and not (set(toks) & _NO_NAME_TOKENS) and len(key) >= 4
                    and all(len(t) >= 3 or t in ("of", "fc") for t in toks)):  # no stray "E" surnames
                self.used.add(key)
                return name
        raise RuntimeError("name space exhausted")  # cannot happen at supported sizes

    def person(self) -> str:
        r = self.rng
        return self.take(lambda: f"{self.word(2)} {self.word(r.choice([1, 2, 2]))}{r.choice(_SURNAME_END)}")

    def city(self) -> str:
        r = self.rng

        def make():
            end = r.choice(_CITY_END)
            base = self.word(r.choice([1, 2]) if end else r.choice([2, 2, 3])) + end
            return (r.choice(_CITY_PRE) + base) if r.random() < 0.08 else base
        return self.take(make)

    def country(self) -> str:
        return self.take(lambda: self.word(self.rng.choice([1, 2])) + self.rng.choice(_COUNTRY_END))

    def continent(self) -> str:
        return self.take(lambda: self.word(2) + self.rng.choice(_CONTINENT_END))

    def work(self) -> str:
        r = self.rng

        def make():
            x = r.random()
            if x < 0.35:
                return f"The {r.choice(_ADJ)} {r.choice(_NOUN)}"
            if x < 0.6:
                return f"{r.choice(_ADJ)} {r.choice(_NOUN)}"
            if x < 0.8:
                return f"{r.choice(_NOUN)} of {self.word(2)}"
            if x < 0.9:
                return f"The {r.choice(_NOUN)} of {r.choice(_NOUN)}s"
            return f"{self.word(2)} {r.choice(_NOUN)}"
        return self.take(make)


def _split_counts(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder rounding of ``total`` into shares proportional to ``weights``."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


class _World:
    """The entity graph, its documents and its question generator."""

    def __init__(self, cfg: WorldConfig, n_entities: int):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.names = _Names(self.rng)
        self.ents: dict[str, Entity] = {}
        self.by_type: dict[str, list[Entity]] = {t: [] for t in ("country", "city", "org", "person", "work")}
        self._build(n_entities)

    # ------------------------------------------------------------------ graph
    def _add(self, prefix: str, etype: str, kind: str, name: str, **attrs) -> Entity:
        e = Entity(id=f"{prefix}{len(self.by_type[etype]) + 1:05d}", type=etype, kind=kind, name=name, attrs=attrs)
        self.ents[e.id] = e
        self.by_type[etype].append(e)
        return e

    def _build(self, n: int) -> None:
        rng, names = self.rng, self.names
        n_country = max(4, n // 40)
        n_city = max(12, round(n * 0.14))
        n_org = max(12, round(n * 0.14))
        n_work = max(15, round(n * 0.24))
        n_person = n - n_country - n_city - n_org - n_work

        continents = [names.continent() for _ in range(min(6, max(2, n_country // 3)))]
        for _ in range(n_country):
            cname = names.country()
            self._add("K", "country", "country", cname, continent=rng.choice(continents),
                      official_name=f"{rng.choice(_COUNTRY_FORMS)} of {cname}",
                      population_m=rng.randint(1, 90),
                      currency=f"{names.word(2)} {rng.choice(['mark', 'crown', 'dinar', 'florin'])}")
        countries = self.by_type["country"]
        for i in range(n_city):
            k = countries[i] if i < n_country else rng.choice(countries)
            if i < n_country and rng.random() < 0.3:
                # capital named after its country: "Kessaro" vs "Kessaro City" must be told apart
                cname = names.take(lambda k=k: f"{k.name} City")
            else:
                cname = names.city()
            c = self._add("C", "city", "city", cname, population=rng.randint(20, 4000) * 1000)
            c.rels["country"] = k.id
            if i < n_country:
                k.rels["capital"] = c.id
                c.attrs["capital_of"] = k.id
        cities = self.by_type["city"]

        occ_pool = (["film director"] * 3 + ["novelist"] * 2 + ["writer"] + ["singer"] * 2 + ["composer"]
                    + _OTHER_OCCS)
        for _ in range(n_person):
            occ = rng.choice(occ_pool)
            p = self._add("P", "person", occ, names.person(), birth_year=rng.randint(1800, 1995),
                          gender=rng.choice("fm"))
            p.rels["birth_city"] = rng.choice(cities).id
        persons = self.by_type["person"]
        # each country is led by a distinct politician (a person-valued hop out of a country)
        politicians = [p for p in persons if p.kind == "politician"]
        others = [p for p in persons if p.kind in _OTHER_OCCS and p.kind != "politician"]
        rng.shuffle(others)
        while len(politicians) < n_country:
            p = others.pop()
            p.kind = "politician"
            politicians.append(p)
        for k, p in zip(countries, rng.sample(politicians, n_country)):
            k.rels["leader"] = p.id
            p.attrs["leads"] = k.id
        # creators of every work kind must exist even in tiny worlds
        for occs in _CREATOR_OCCS.values():
            if not any(p.kind in occs for p in persons):
                rng.choice([p for p in persons if p.kind in _OTHER_OCCS and "leads" not in p.attrs]).kind = occs[0]

        industries = ["film studio", "publishing house", "record label"]
        old_enough = [p for p in persons if p.attrs["birth_year"] <= 1975] or persons
        for i in range(n_org):
            x = rng.random()
            if i < 6:  # at least two publishers of each kind
                kind, industry = "company", industries[i % 3]
            elif x < 0.6:
                kind = "company"
                industry = rng.choice(industries + _OTHER_INDUSTRIES)
            else:
                kind, industry = ("university", None) if x < 0.8 else ("club", None)
            founder = rng.choice(old_enough)
            year = min(2020, founder.attrs["birth_year"] + rng.randint(25, 60))
            hq = rng.choice(cities)
            if kind == "company":
                suffixes = _INDUSTRY_SUFFIX[industry]
                oname = names.take(lambda sfx=suffixes: f"{names.word(rng.choice([1, 2]))} {rng.choice(sfx)}")
            elif kind == "university":
                oname = names.take(lambda hq=hq: rng.choice([f"University of {hq.name}", f"{hq.name} University",
                                                       f"{names.word(2)} Institute", f"{names.word(2)} College"]))
            else:
                oname = names.take(lambda hq=hq: rng.choice([f"{hq.name} United", f"{hq.name} Rovers", f"FC {hq.name}",
                                                       f"Athletic {names.word(2)}", f"{names.word(2)} Wanderers"]))
            o = self._add("O", "org", kind, oname, founded_year=year, employees=rng.randint(5, 900) * 10)
            if industry:
                o.attrs["industry"] = industry
            o.rels["founder"] = founder.id
            o.rels["headquarters"] = hq.id
        orgs = self.by_type["org"]

        # employers by (kind, industry), oldest first, so "founded before the person's 55th year" is a prefix
        by_sector: dict[tuple, list[Entity]] = {}
        for o in orgs:
            by_sector.setdefault((o.kind, None), []).append(o)
            if o.attrs.get("industry"):
                by_sector.setdefault((o.kind, o.attrs["industry"]), []).append(o)
        for g in by_sector.values():
            g.sort(key=lambda o: (o.attrs["founded_year"], o.id))
        founded = {k: [o.attrs["founded_year"] for o in g] for k, g in by_sector.items()}
        for p in persons:
            if rng.random() < 0.7:
                sector = _EMPLOYER.get(p.kind, ("company", None))
                n_ok = bisect.bisect_right(founded.get(sector, []), p.attrs["birth_year"] + 55)
                if n_ok:
                    p.rels["employer"] = by_sector[sector][rng.randrange(n_ok)].id
        singles = [p for p in persons]
        rng.shuffle(singles)
        singles.sort(key=lambda p: p.attrs["birth_year"])  # stable: ties keep the shuffled order
        for a, b in zip(singles[0::2], singles[1::2]):
            if rng.random() < 0.35 and abs(a.attrs["birth_year"] - b.attrs["birth_year"]) <= 12:
                a.rels["spouse"], b.rels["spouse"] = b.id, a.id

        creators = {kind: [p for p in persons if p.kind in occs] for kind, occs in _CREATOR_OCCS.items()}
        for _ in range(n_work):
            kind = rng.choice(["film", "film", "novel", "novel", "album"])
            c = rng.choice(creators[kind])
            year = rng.randint(c.attrs["birth_year"] + 20, min(c.attrs["birth_year"] + 70, 2023))
            w = self._add("W", "work", kind, names.work(), release_year=year, genre=rng.choice(
                {"film": ["drama", "comedy", "thriller", "western", "documentary"],
                 "novel": ["historical", "crime", "adventure", "satirical", "gothic"],
                 "album": ["jazz", "folk", "rock", "electronic", "choral"]}[kind]))
            w.rels["creator"] = c.id
            sector = ("company", _PUBLISHER_INDUSTRY[kind])
            n_ok = bisect.bisect_left(founded.get(sector, []), year)  # founded strictly before the release
            if n_ok:
                w.rels["publisher"] = by_sector[sector][rng.randrange(n_ok)].id

        self._make_namesakes()
        self._assign_titles()
        # indexes the document and question generators need (built once names are final)
        self.key = {e.id: normalize_answer(e.name) for e in self.ents.values()}
        self.works_by = {}
        self.works_of_kind = {k: [w for w in self.by_type["work"] if w.kind == k] for k in _CREATOR_OCCS}
        for w in self.by_type["work"]:
            self.works_by.setdefault(w.rels["creator"], []).append(w)
        self.groups = {}  # (type, relation) -> target id -> entities sharing that target
        self.pairable = {}  # (type, relation) -> entities that share their target with another
        for etype, rel in (("city", "country"), ("person", "birth_city"), ("org", "headquarters")):
            g = self.groups[(etype, rel)] = {}
            for e in self.by_type[etype]:
                g.setdefault(e.rels[rel], []).append(e)
            self.pairable[(etype, rel)] = [e for e in self.by_type[etype] if len(g[e.rels[rel]]) > 1]
        # works of one kind whose creators share a birth city: the "yes" side of a bridge comparison
        self.works_by_creator_city = {}
        for w in self.by_type["work"]:
            city = self.ents[w.rels["creator"]].rels["birth_city"]
            self.works_by_creator_city.setdefault((w.kind, city), []).append(w)

    def _make_namesakes(self) -> None:
        """Rename some entities to clash with another of a different kind (the confusable distractors)."""
        rng = self.rng
        n_pairs = round(self.cfg.shared_name_frac * len(self.ents) / 2)
        persons, works, cities = self.by_type["person"], self.by_type["work"], self.by_type["city"]
        renamed: set[str] = set()
        for _ in range(n_pairs):
            x = rng.random()
            if x < 0.5:
                a, b = rng.choice(persons), rng.choice(persons)
                if a.kind == b.kind:
                    continue
                new = a.name
            elif x < 0.8:
                a, b = rng.choice(works), rng.choice(works)
                if a.kind == b.kind:
                    continue
                # near-identical: "The Red Harbour" vs "Red Harbour" normalise alike
                new = a.name[4:] if a.name.startswith("The ") else ("The " + a.name if rng.random() < 0.5 else a.name)
            else:
                a, b = rng.choice(cities), rng.choice([w for w in works if w.kind != "film"])
                new = a.name
            if a.id == b.id or a.id in renamed or b.id in renamed:
                continue
            renamed.update((a.id, b.id))
            b.name = new

    def _assign_titles(self) -> None:
        groups: dict[str, list[Entity]] = {}
        for e in self.ents.values():
            groups.setdefault(normalize_answer(e.name), []).append(e)
        for key in sorted(groups):
            g = groups[key]
            if len(g) == 1:
                g[0].title = g[0].name
                continue
            quals = [e.qualifier for e in g]
            if len(set(quals)) < len(quals):
                # two namesakes of the same kind could not be told apart: give the later ones fresh names
                seen: set[str] = set()
                keep = []
                for e in g:
                    if e.qualifier in seen:
                        e.name = self.names.person() if e.type == "person" else self.names.work()
                        e.title = e.name
                    else:
                        seen.add(e.qualifier)
                        keep.append(e)
                g = keep
                if len(g) == 1:
                    g[0].title = g[0].name
                    continue
            primary = self.rng.randrange(len(g))  # one namesake keeps the bare title, as on Wikipedia
            for i, e in enumerate(g):
                e.shared = True
                e.title = e.name if i == primary else f"{e.name} ({e.qualifier})"
        titles = [e.title for e in self.ents.values()]
        assert len(set(titles)) == len(titles), "document titles must be unique"

    # ------------------------------------------------------------------ facts
    def value(self, e: Entity, rel: str) -> Any:
        """The object of (e, rel): an Entity for entity relations, a literal for the rest, or None."""
        if rel in ENTITY_RELS:
            tid = e.rels.get(rel)
            return self.ents[tid] if tid else None
        if rel == "occupation":
            return e.kind if e.type == "person" else None
        if rel == "continent":
            return e.attrs.get("continent")
        return e.attrs.get(rel)

    def entity_rels(self, e: Entity) -> list[str]:
        return [r for r in ENTITY_RELS if e.rels.get(r)]

    def literal_rels(self, e: Entity) -> list[str]:
        return [r for r in LITERAL_RELS if self.value(e, r) is not None]

    @staticmethod
    def answer_of(v: Any, rel: str) -> tuple[str, list[str]]:
        if isinstance(v, Entity):
            return v.name, v.aliases()
        s = str(v)
        if rel == "occupation":
            return s, [s] + _OCC_ALIASES.get(s, [])
        return s, [s]

    # ------------------------------------------------------------------ documents
    def document(self, e: Entity) -> str:
        rng = self.rng
        pron = {"f": ("she", "her"), "m": ("he", "his")}.get(e.attrs.get("gender"), ("it", "its"))
        short = e.name.split()[-1] if e.type == "person" else e.name

        def fill(tmpl: str, first: bool, **kw) -> str:
            # the subject is the full name in the first sentence, then name, surname or pronoun
            if first or not tmpl.startswith("{s}"):
                s = e.name
            else:
                s = rng.choice([e.name, short, pron[0]])
            return _cap(tmpl.format(s=s, pos=pron[1], **kw))

        facts: list[tuple[str, dict]] = []  # (template, fields); the first becomes the lead sentence
        fillers: list[str] = []
        T = _DOC_TEMPLATES
        if e.type == "person":
            city, year, occ = self.value(e, "birth_city"), e.attrs["birth_year"], e.kind
            lead = None  # the occupation sentence leads, so the full name opens the document
            facts.append((rng.choice(T["occupation"]), {"o": occ}))
            if rng.random() < 0.6:
                facts.append((rng.choice(T["birth_both"]), {"c": city.mention(), "y": year}))
            else:
                facts.append((rng.choice(T["birth_year"]), {"y": year}))
                facts.append((rng.choice(T["birth_city"]), {"c": city.mention()}))
            if (org := self.value(e, "employer")) is not None:
                facts.append((rng.choice(T["employer"]), {"o": org.mention()}))
            if (sp := self.value(e, "spouse")) is not None:
                facts.append((rng.choice(T["spouse"]), {"o": sp.mention()}))
            if e.attrs.get("leads"):
                facts.append((rng.choice(T["leads"]), {"k": self.ents[e.attrs["leads"]].mention()}))
            made = self.works_by.get(e.id, [])[:2]
            if made:
                facts.append(("Works by {s} include " + " and ".join("{w%d}" % i for i in range(len(made))) + ".",
                              {f"w{i}": w.mention() for i, w in enumerate(made)}))
            fillers = [f.format(s=e.name, pos=pron[1], y=min(2024, year + rng.randint(25, 55)), a=self.names.word(2),
                                adj=rng.choice(["bold", "restrained", "playful", "austere"]))
                       for f in T["person_filler"]]
            lead_fields = {}
        elif e.type == "work":
            c, year, kind = self.value(e, "creator"), e.attrs["release_year"], e.kind
            lead = rng.choice(T["work_lead"])
            facts.append((rng.choice(T[f"creator_{kind}"]), {"o": c.mention()}))
            facts.append((rng.choice(T[f"release_{kind}"]), {"y": year}))
            if (pub := self.value(e, "publisher")) is not None:
                facts.append((rng.choice(T[f"publisher_{kind}"]), {"o": pub.mention()}))
            unit = {"film": ("runs for", "minutes", 80, 190), "novel": ("spans", "pages", 150, 900),
                    "album": ("contains", "tracks", 6, 18)}[kind]
            fillers = [f"It {unit[0]} {rng.randint(unit[2], unit[3])} {unit[1]}.",
                       f"The {kind} received {rng.choice(['mixed', 'warm', 'lukewarm', 'glowing'])} reviews.",
                       f"Reviewers singled out its {rng.choice(['pacing', 'imagery', 'ending', 'tone'])}."]
            lead_fields = {"k": kind, "g": e.attrs["genre"]}
        elif e.type == "org":
            lead = rng.choice(T["org_lead"])
            founder, year, hq = self.value(e, "founder"), e.attrs["founded_year"], self.value(e, "headquarters")
            if rng.random() < 0.4:
                facts.append((rng.choice(T["founded_both"]), {"o": founder.mention(), "y": year}))
            else:
                facts.append((rng.choice(T["founded_year"]), {"y": year}))
                facts.append((rng.choice(T["founder"]), {"o": founder.mention()}))
            facts.append((rng.choice(T[f"hq_{e.kind}"]), {"c": hq.mention()}))
            fillers = [f"It employs about {e.attrs['employees']} people.",
                       f"Its emblem shows a {rng.choice(['lion', 'heron', 'oak', 'star', 'anchor'])}.",
                       f"{e.name} expanded steadily during the {min(2010, year // 10 * 10 + 30)}s."]
            lead_fields = {"k": e.qualifier}
        elif e.type == "city":
            lead = None
            k = self.value(e, "country")
            facts.append((rng.choice(T["country"]), {"k": k.mention()}))
            if e.attrs.get("capital_of"):
                facts.append((rng.choice(T["capital_of"]), {"k": k.mention()}))
            fillers = [f"{e.name} has a population of about {e.attrs['population']}.",
                       f"The river {self.names.word(2)} flows through the city.",
                       "The city is known for its "
                       f"{rng.choice(['markets', 'bridges', 'festivals', 'harbour', 'cathedral'])}."]
            lead_fields = {}
        else:  # country
            lead = rng.choice(T["country_lead"])
            facts.append((rng.choice(T["continent"]), {"k": e.attrs["continent"]}))
            facts.append((rng.choice(T["capital"]), {"c": self.value(e, "capital").mention()}))
            facts.append((rng.choice(T["leader"]), {"o": self.value(e, "leader").mention()}))
            fillers = [f"The currency of {e.name} is the {e.attrs['currency']}.",
                       f"{e.name} has about {e.attrs['population_m']} million inhabitants.",
                       f"The official language of {e.name} is {self.names.word(2)}ic."]
            lead_fields = {"f": e.attrs["official_name"]}

        sentences: list[str] = []
        if lead is not None:
            sentences.append(_cap(lead.format(s=e.name, **lead_fields)))
        else:
            t, kw = facts.pop(0)
            sentences.append(fill(t, True, **kw))
        rng.shuffle(facts)
        sentences += [fill(t, False, **kw) for t, kw in facts]
        rng.shuffle(fillers)
        for f in fillers[: rng.randint(0, self.cfg.max_filler)]:
            sentences.insert(rng.randint(1, len(sentences)), _cap(f))
        return _articles(" ".join(sentences))

    # ------------------------------------------------------------------ questions
    def _step(self, e: Entity, rel: str) -> dict:
        """One gold sub-step: a direct question naming ``e`` (qualified if its name is shared)."""
        ans, aliases = self.answer_of(self.value(e, rel), rel)
        q = _cap(self.rng.choice(_qtemplates(rel, e, nested=False)).format(x=e.mention()))
        return {"question": q, "answer": ans, "answer_aliases": aliases, "doc_id": e.id, "title": e.title}

    def _walk(self, hops: int) -> tuple[list[Entity], list[str]] | None:
        rng = self.rng
        pool = self.by_type[rng.choice(["work", "work", "person", "person", "org", "city", "country"])]
        e = rng.choice(pool)
        nodes, rels, seen = [], [], {e.id}
        for i in range(hops):
            last = i == hops - 1
            ent = [r for r in self.entity_rels(e) if e.rels[r] not in seen]
            lits = self.literal_rels(e) if last else []
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
                e = self.value(e, r)
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
        q = _cap(self.rng.choice(_qtemplates(rels[-1], nodes[-1], nested=hops > 1)).format(x=x))
        return {"question": q, "golden_answers": steps[-1]["answer_aliases"], "type": "compositional", "hops": hops,
                "steps": steps, "chain": _chain(nodes, rels)}

    def _pair(self, draw: Callable[[], tuple[Entity, Entity] | None], tries: int = 30):
        """Retry ``draw`` until it yields a usable pair (names told apart), else None."""
        for _ in range(tries):
            pair = draw()
            if pair is not None and pair[0].id != pair[1].id and self.key[pair[0].id] != self.key[pair[1].id]:
                return pair
        return None

    def comparison(self, want_yes: bool) -> dict | None:
        rng = self.rng
        kind = rng.choice(["born", "born", "founded", "released", "same_country", "same_birth_city", "same_hq"])
        if kind in ("born", "founded", "released"):
            etype, rel = {"born": ("person", "birth_year"), "founded": ("org", "founded_year"),
                          "released": ("work", "release_year")}[kind]
            pool = self.by_type[etype]

            def draw():
                a, b = rng.sample(pool, 2)
                return (a, b) if self.value(a, rel) != self.value(b, rel) else None
            pair = self._pair(draw)
            if pair is None:
                return None
            a, b = pair
            earlier = rng.random() < 0.6
            q = _cap(rng.choice(_CMP[kind][earlier]).format(a=a.mention(), b=b.mention()))
            win = a if (self.value(a, rel) < self.value(b, rel)) == earlier else b
            golden = win.aliases()
        else:
            etype, rel = {"same_country": ("city", "country"), "same_birth_city": ("person", "birth_city"),
                          "same_hq": ("org", "headquarters")}[kind]
            pool, groups = self.by_type[etype], self.groups[(etype, rel)]
            # "yes" pairs come from a group sharing the value; the caller alternates so yes/no stay balanced
            if want_yes and not self.pairable[(etype, rel)]:
                return None

            def draw():
                if want_yes:
                    a = rng.choice(self.pairable[(etype, rel)])
                    return a, rng.choice(groups[a.rels[rel]])
                a, b = rng.sample(pool, 2)
                return (a, b) if a.rels[rel] != b.rels[rel] else None
            pair = self._pair(draw)
            if pair is None:
                return None
            a, b = pair
            q = _cap(rng.choice(_CMP[kind]).format(a=a.mention(), b=b.mention()))
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
            bridge_rel, pool, noun = "founder", self.by_type["org"], None
        else:
            noun = rng.choice(["film", "novel", "album"])
            bridge_rel, pool = "creator", self.works_of_kind[noun]
        if len(pool) < 2:
            return None

        def draw():
            a, b = rng.sample(pool, 2)
            if kind == "creator_same_city" and want_yes:
                city = self.value(a, "creator").rels["birth_city"]
                b = rng.choice(self.works_by_creator_city[(a.kind, city)])
            ma, mb = self.value(a, bridge_rel), self.value(b, bridge_rel)
            if ma.id == mb.id:
                return None
            if kind == "creator_same_city":
                return (a, b) if (ma.rels["birth_city"] == mb.rels["birth_city"]) == want_yes else None
            return (a, b) if ma.attrs["birth_year"] != mb.attrs["birth_year"] else None
        pair = self._pair(draw)
        if pair is None:
            return None
        a, b = pair
        ma, mb = self.value(a, bridge_rel), self.value(b, bridge_rel)
        fmt = {"a": a.mention(), "b": b.mention(), "k": noun or "", "r": _ROLE.get(noun or "", "")}
        if kind == "creator_same_city":
            rel = "birth_city"
            q = _cap(rng.choice(_BRIDGE["same_city"]).format(**fmt))
            golden = ["yes" if want_yes else "no"]
        else:
            rel = "birth_year"
            ya, yb = ma.attrs["birth_year"], mb.attrs["birth_year"]
            earlier = rng.random() < 0.6
            key = "creator" if kind == "creator_born" else "founder"
            q = _cap(rng.choice(_BRIDGE[key][earlier]).format(**fmt))
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
# {s} subject, {o} related entity / occupation, {c} city, {k} country/continent, {y} year.

_DOC_TEMPLATES: dict[str, list[str]] = {
    "birth_both": ["{s} was born in {c} in {y}.", "{s} was born in {y} in {c}.",
                   "Born in {c} in {y}, {s} grew up there.",
                   "{c} is the birthplace of {s}, who was born there in {y}."],
    "birth_year": ["{s} was born in {y}.", "{s} was born in the year {y}.", "The year {y} saw the birth of {s}."],
    "birth_city": ["{s} was born in {c}.", "{s} is a native of {c}.", "{c} is the birthplace of {s}.",
                   "{s} came from {c}, where {pos} family lived."],
    "occupation": ["{s} was a {o}.", "{s} worked as a {o}.", "{s} is remembered as a {o}.",
                   "{s} made a name as a {o}.", "{s} trained and worked as a {o}."],
    "employer": ["{s} worked for {o}.", "{s} was employed by {o}.", "{o} employed {s} for many years.",
                 "{s} spent most of {pos} career at {o}."],
    "spouse": ["{s} was married to {o}.", "{s} married {o}.", "{o} was the spouse of {s}.",
               "{s} and {o} were married."],
    "person_filler": ["{s} received the {a} Prize in {y}.", "Critics described {pos} work as {adj}.",
                      "{s} spent several years travelling abroad.", "Little is known about {pos} early schooling."],
    "work_lead": ["{s} is a {k}.", "{s} is a {g} {k}.", "{s} is a {k} in the {g} genre."],
    "creator_film": ["{s} was directed by {o}.", "{o} directed {s}.", "The director of {s} is {o}.",
                     "{s} is a film by the director {o}."],
    "creator_novel": ["{s} was written by {o}.", "{o} wrote {s}.", "The author of {s} is {o}.",
                      "{s} is a novel by {o}."],
    "creator_album": ["{s} was recorded by {o}.", "{o} recorded {s}.", "The artist behind {s} is {o}.",
                      "{s} is an album by {o}."],
    "release_film": ["{s} was released in {y}.", "{s} premiered in {y}.", "{s} first reached cinemas in {y}.",
                     "The film came out in {y}."],
    "release_novel": ["{s} was published in {y}.", "{s} first appeared in print in {y}.",
                      "The novel came out in {y}."],
    "release_album": ["{s} was released in {y}.", "{s} came out in {y}.", "The album appeared in {y}."],
    "publisher_film": ["{s} was produced by {o}.", "{o} produced {s}.", "The studio behind {s} was {o}."],
    "publisher_novel": ["{s} was published by {o}.", "{o} published {s}.", "The publisher of {s} is {o}."],
    "publisher_album": ["{s} was released on the label {o}.", "{o} released {s}.", "{s} came out on the label {o}."],
    "org_lead": ["{s} is a {k}.", "{s} is a {k} with a long history.", "{s} is a well-known {k}."],
    "founded_both": ["{o} founded {s} in {y}.", "{s} was founded in {y} by {o}.",
                     "In {y}, {o} established {s}."],
    "founded_year": ["{s} was founded in {y}.", "{s} was established in {y}.",
                     "The year {y} marked the founding of {s}."],
    "founder": ["{s} was founded by {o}.", "{o} founded {s}.", "The founder of {s} was {o}."],
    "hq_company": ["{s} is headquartered in {c}.", "{s} has its head office in {c}.",
                   "The headquarters of {s} are located in {c}."],
    "hq_university": ["{s} has its main campus in {c}.", "{s} is located in {c}.", "The campus of {s} lies in {c}."],
    "hq_club": ["{s} plays its home matches in {c}.", "{s} is based in {c}.", "The home ground of {s} is in {c}."],
    "country": ["{s} is a city in {k}.", "{s} lies in {k}.", "{s} is a city located in {k}.",
                "Located in {k}, {s} is a regional centre."],
    "capital_of": ["{s} is the capital of {k}.", "{s} serves as the capital of {k}.",
                   "The government of {k} sits in {s}, its capital."],
    "country_lead": ["{s}, officially the {f}, is a country.", "{s} (officially the {f}) is a sovereign state.",
                     "The {f}, usually called {s}, is a country."],
    "continent": ["{s} is a country in {k}.", "{s} lies on the continent of {k}.", "{s} is located in {k}.",
                  "{k} is the continent where {s} is found."],
    "leader": ["The head of state of {s} is {o}.", "{s} is led by {o}.", "{o} serves as head of state of {s}.",
               "{o} leads {s} as its head of state."],
    "leads": ["{s} is the head of state of {k}.", "{s} leads {k}.", "{s} serves as head of state of {k}."],
    "capital": ["The capital of {s} is {c}.", "{c} is the capital of {s}.", "{s} has its capital at {c}.",
                "The capital city of {s} is {c}."],
}

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
            found.add(_cap(first.format(x=x)))
    return found.pop() if len(found) == 1 else question


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


# ============================================================================ build

def generate_world(cfg: WorldConfig, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Generate everything in memory: ``{"docs", "splits", "entities", "relations", "counts"}``."""
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
    w, world, seen_chains, seen_text = _generate(cfg, None)
    hops = [h for h in (3, 4) if h >= min_hops]
    weights = [{3: cfg.frac_3hop, 4: cfg.frac_4hop}[h] for h in hops]

    def draw(count: int, name: str) -> list[dict]:
        rows: list[dict] = []
        for h, target in zip(hops, _split_counts(count, weights)):
            made, tries = 0, 0
            while made < target and tries < 60 * target + 500:
                tries += 1
                q = world.compositional(h)
                if q is None or q["chain"] in seen_chains or q["question"] in seen_text:
                    continue
                seen_chains.add(q["chain"])
                seen_text.add(q["question"])
                rows.append(q)
                made += 1
        world.rng.shuffle(rows)
        return [_row(name, i, q) for i, q in enumerate(rows)]

    test_rows = draw(n, DEEP_SPLIT)
    if not dev:
        return w, test_rows
    return w, test_rows, draw(dev, DEV_DEEP_SPLIT)


def _generate(cfg: WorldConfig, progress: Callable[[str, int, int], None] | None):
    """generate_world's output, and the generator and what it has used, for :func:`generate_deep_split`."""
    counts = cfg.resolved()
    world = _World(cfg, counts["entities"])
    report = progress or (lambda stage, done, total: None)
    ents = sorted(world.ents.values(), key=lambda e: e.id)
    report("entities", len(ents), len(ents))

    docs = []
    for e in ents:
        docs.append({"id": e.id, "contents": format_contents(e.title, world.document(e))})
        if len(docs) % 2000 == 0:
            report("documents", len(docs), len(ents))
    report("documents", len(docs), len(ents))

    seen_chains: set[str] = set()
    seen_text: set[str] = set()
    splits: dict[str, list[dict]] = {}
    mix = cfg.mix()
    # evaluation splits first, so a small world fills them before train takes what is left
    for split in ("test", "dev", "train"):
        rows: list[dict] = []
        targets = _split_counts(counts[split], [mix[c] for c in CATEGORIES])
        for cat, target in zip(CATEGORIES, targets):
            made, tries = 0, 0
            yes_no = Counter()
            while made < target and tries < 60 * target + 500:
                tries += 1
                q = world.make(cat, want_yes=yes_no["yes"] <= yes_no["no"])
                if q is None or q["chain"] in seen_chains or q["question"] in seen_text:
                    continue
                seen_chains.add(q["chain"])
                seen_text.add(q["question"])
                rows.append(q)
                yes_no[q["golden_answers"][0]] += 1
                made += 1
        world.rng.shuffle(rows)
        splits[split] = [_row(split, i, q) for i, q in enumerate(rows)]
        report(f"questions {split}", len(rows), counts[split])

    entities = [{"id": e.id, "type": e.type, "kind": e.kind, "name": e.name, "title": e.title,
                 "shared_name": e.shared, "attrs": e.attrs, "rels": e.rels} for e in ents]
    relations = [[e.id, r, t] for e in ents for r, t in sorted(e.rels.items())]
    return ({"docs": docs, "splits": {s: splits[s] for s in SPLITS}, "entities": entities, "relations": relations},
            world, seen_chains, seen_text)


def _row(split: str, i: int, q: dict) -> dict:
    sup = list(dict.fromkeys(s["doc_id"] for s in q["steps"] if s["doc_id"]))
    return {"id": f"{split}_{i}", "question": q["question"], "golden_answers": list(q["golden_answers"]),
            "metadata": {"type": q["type"], "hops": q["hops"], "decomposition": q["steps"],
                         "supporting_doc_ids": sup, "chain": q["chain"]}}


def _summary(cfg: WorldConfig, out_dir: Path, splits: dict[str, list[dict]], n_entities: int, seconds: float,
             reused: bool) -> WorldSummary:
    by_type: dict[str, dict[str, int]] = {}
    by_hops: dict[str, dict[str, int]] = {}
    for s, rows in splits.items():
        bt: dict[str, int] = {}
        bh: dict[str, int] = {}
        for r in rows:
            m = r.get("metadata") or {}
            bt[m.get("type", "unknown")] = bt.get(m.get("type", "unknown"), 0) + 1
            bh[str(m.get("hops", 0))] = bh.get(str(m.get("hops", 0)), 0) + 1
        by_type[s] = dict(sorted(bt.items()))
        by_hops[s] = dict(sorted(bh.items()))
    paths = {n: str(out_dir / f"{n}.jsonl") for n in ("corpus", *SPLITS)}
    paths["world"] = str(out_dir / "world.json")
    return WorldSummary(name=cfg.name, seed=cfg.seed, size=cfg.size, out_dir=str(out_dir), n_entities=n_entities,
                        n_docs=n_entities, splits={s: len(r) for s, r in splits.items()}, by_type=by_type,
                        by_hops=by_hops, paths=paths, seconds=round(seconds, 3), reused=reused)


def build_world(cfg: WorldConfig, out_dir: str | Path, progress: Callable[[str, int, int], None] | None = None,
                force: bool = False) -> WorldSummary:
    """Write the world's files into ``out_dir``; a finished build of the same config is reused unless ``force``.

    ``progress(stage, done, total)`` is called after each stage.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    done = out_dir / "DONE"
    cfg_dict = to_dict(cfg)
    if done.exists() and not force:
        try:
            meta = json.loads((out_dir / "world.json").read_text())
        except (OSError, ValueError):
            meta = {}
        if meta.get("version") == WORLD_VERSION and meta.get("config") == cfg_dict:
            splits = {s: list(read_jsonl(out_dir / f"{s}.jsonl")) for s in SPLITS}
            return _summary(cfg, out_dir, splits, meta["counts"]["entities"], time.perf_counter() - t0, True)
    out_dir.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # from here on the folder is a partial build until DONE is back

    w = generate_world(cfg, progress)
    _check_disjoint(w["splits"])
    report = progress or (lambda stage, done, total: None)
    write_jsonl(out_dir / "corpus.jsonl", w["docs"])
    for s in SPLITS:
        write_jsonl(out_dir / f"{s}.jsonl", w["splits"][s])
    type_counts: dict[str, int] = {}
    for e in w["entities"]:
        type_counts[e["type"]] = type_counts.get(e["type"], 0) + 1
    counts = {"entities": len(w["entities"]), "documents": len(w["docs"]), "entity_types": type_counts,
              "shared_names": sum(e["shared_name"] for e in w["entities"]),
              "questions": {s: len(w["splits"][s]) for s in SPLITS}}
    write_json(out_dir / "world.json", {"version": WORLD_VERSION, "name": cfg.name, "seed": cfg.seed,
                                        "config": cfg_dict, "counts": counts, "entities": w["entities"],
                                        "relations": w["relations"]})
    write_text(done, json.dumps({"version": WORLD_VERSION, "seed": cfg.seed}) + "\n")
    report("written", 1, 1)
    return _summary(cfg, out_dir, w["splits"], len(w["entities"]), time.perf_counter() - t0, False)


def ensure_deep_split(out_dir: str | Path, n: int, split: str = "test") -> Path:
    """``{out_dir}/test_deep.jsonl`` with ``n`` questions of 3+ hops (:func:`generate_deep_split`) for a finished
    world, written once (atomically) and reused. The world is regenerated in memory from its recorded config;
    if that does not reproduce its splits on disk (built by another generator version), nothing is written
    and FailedPrecondition says to rebuild it.

    ``split="dev"``: ``dev_deep.jsonl``, ``n`` questions drawn after the test deep split (as many as are on disk,
    or ``n`` when there is none yet, then written too), so that no dev question is a test one. A test deep split
    rewritten with another size invalidates the dev one, which is drawn again on its next use."""
    from prorag.errors import FailedPrecondition, InvalidArgument

    if split not in DEEP_SPLITS:
        raise InvalidArgument(f"no deep split for {split!r}: one of {sorted(DEEP_SPLITS)}")
    out_dir = Path(out_dir)
    test_path, path = out_dir / f"{DEEP_SPLIT}.jsonl", out_dir / f"{DEEP_SPLITS[split]}.jsonl"
    if not (out_dir / "DONE").exists():
        raise FileNotFoundError(f"{out_dir}: no finished world (DONE missing); run `prorag world`")
    test_n = sum(1 for _ in read_jsonl(test_path)) if test_path.exists() else 0
    dev_after = out_dir / f"{DEV_DEEP_SPLIT}.after"  # the test deep split's size the dev one was drawn after
    if path.exists() and sum(1 for _ in read_jsonl(path)) == n and (
            split == "test" or (dev_after.exists() and dev_after.read_text().strip() == str(test_n))):
        return path
    meta = json.loads((out_dir / "world.json").read_text())
    cfg = from_dict(WorldConfig, meta["config"])
    if split == "test":
        w, rows = generate_deep_split(cfg, n)
    else:
        test_n = test_n or n
        w, test_rows, rows = generate_deep_split(cfg, test_n, dev=n)
    for s in SPLITS:
        on_disk = [(r["id"], r["question"]) for r in read_jsonl(out_dir / f"{s}.jsonl")]
        if on_disk != [(r["id"], r["question"]) for r in w["splits"][s]]:
            raise FailedPrecondition(f"{out_dir}: its {s} split is not what this generator makes from the world's "
                                     f"config (built by another version): rebuild it (`prorag world --name "
                                     f"{cfg.name} --force`) to add the {DEEP_SPLIT} split")
    if split == "test":
        write_jsonl(path, rows)
        if dev_after.exists() and dev_after.read_text().strip() != str(n):
            dev_after.unlink()  # drawn after a test deep split of another size: drawn again when next asked for
        return path
    if not test_path.exists():
        write_jsonl(test_path, test_rows)
    write_jsonl(path, rows)
    write_text(dev_after, f"{test_n}\n")
    return path


def load_summary(out_dir: str | Path) -> dict:
    """The summary (as a dict) of a finished world folder, without rebuilding anything."""
    out_dir = Path(out_dir)
    if not (out_dir / "DONE").exists():
        raise FileNotFoundError(f"{out_dir}: no finished world (DONE missing); run `prorag world`")
    meta = json.loads((out_dir / "world.json").read_text())
    cfg = from_dict(WorldConfig, meta["config"])
    splits = {s: list(read_jsonl(out_dir / f"{s}.jsonl")) for s in SPLITS}
    return _summary(cfg, out_dir, splits, meta["counts"]["entities"], 0.0, True).to_dict()


def _check_disjoint(splits: dict[str, list[dict]]) -> None:
    """No dev/test chain or question text may occur in train (guaranteed by construction; checked anyway)."""
    train_chains = {r["metadata"]["chain"] for r in splits["train"]}
    train_text = {r["question"] for r in splits["train"]}
    for s in ("dev", "test"):
        for r in splits[s]:
            if r["metadata"]["chain"] in train_chains or r["question"] in train_text:
                raise AssertionError(f"{s} question {r['id']} leaks into train")
