"""The world's entity graph: typed entities (persons, cities, countries, organisations, works), their functional
relations and attributes, and the shared names that make some of them confusable."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Any

from prorag.data.world.config import WorldConfig
from prorag.data.world.names import Names
from prorag.metrics import normalize_answer

_COUNTRY_FORMS = ["Republic", "Kingdom", "Federation", "Commonwealth", "Principality", "Grand Duchy"]

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

# relations: name -> does it point to an entity (else a literal attribute)
ENTITY_RELS = ("creator", "publisher", "birth_city", "employer", "spouse", "founder", "headquarters",
               "country", "capital", "leader")
LITERAL_RELS = ("release_year", "birth_year", "occupation", "founded_year", "continent")


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


class EntityGraph:
    """The typed entities and their relations, and the indexes documents and questions are drawn from."""

    def __init__(self, cfg: WorldConfig, n_entities: int, rng: random.Random):
        self.cfg = cfg
        self.rng = rng
        self.names = Names(rng)
        self.ents: dict[str, Entity] = {}
        self.by_type: dict[str, list[Entity]] = {t: [] for t in ("country", "city", "org", "person", "work")}
        self._build(n_entities)

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
