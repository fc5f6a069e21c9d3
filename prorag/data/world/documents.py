"""Each entity's wiki-style document, stating its relations in one of several phrasings."""

from __future__ import annotations

import random
import re

from prorag.data.world.graph import Entity, EntityGraph
from prorag.data.world.names import cap

_A_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[AEIOUaeiou])")


def _articles(s: str) -> str:
    """'a engineer' -> 'an engineer' (templates write 'a {occupation}')."""
    return _A_BEFORE_VOWEL.sub(r"\1n ", s)


def document(e: Entity, graph: EntityGraph, rng: random.Random, max_filler: int) -> str:
    """The document of ``e``: a lead sentence, its facts in drawn phrasings and order, and up to ``max_filler``
    filler sentences."""
    pron = {"f": ("she", "her"), "m": ("he", "his")}.get(e.attrs.get("gender"), ("it", "its"))
    short = e.name.split()[-1] if e.type == "person" else e.name

    def fill(tmpl: str, first: bool, **kw) -> str:
        # the subject is the full name in the first sentence, then name, surname or pronoun
        if first or not tmpl.startswith("{s}"):
            s = e.name
        else:
            s = rng.choice([e.name, short, pron[0]])
        return cap(tmpl.format(s=s, pos=pron[1], **kw))

    facts: list[tuple[str, dict]] = []  # (template, fields); the first becomes the lead sentence
    fillers: list[str] = []
    T = _DOC_TEMPLATES
    if e.type == "person":
        city, year, occ = graph.value(e, "birth_city"), e.attrs["birth_year"], e.kind
        lead = None  # the occupation sentence leads, so the full name opens the document
        facts.append((rng.choice(T["occupation"]), {"o": occ}))
        if rng.random() < 0.6:
            facts.append((rng.choice(T["birth_both"]), {"c": city.mention(), "y": year}))
        else:
            facts.append((rng.choice(T["birth_year"]), {"y": year}))
            facts.append((rng.choice(T["birth_city"]), {"c": city.mention()}))
        if (org := graph.value(e, "employer")) is not None:
            facts.append((rng.choice(T["employer"]), {"o": org.mention()}))
        if (sp := graph.value(e, "spouse")) is not None:
            facts.append((rng.choice(T["spouse"]), {"o": sp.mention()}))
        if e.attrs.get("leads"):
            facts.append((rng.choice(T["leads"]), {"k": graph.ents[e.attrs["leads"]].mention()}))
        made = graph.works_by.get(e.id, [])[:2]
        if made:
            facts.append(("Works by {s} include " + " and ".join("{w%d}" % i for i in range(len(made))) + ".",
                          {f"w{i}": w.mention() for i, w in enumerate(made)}))
        fillers = [f.format(s=e.name, pos=pron[1], y=min(2024, year + rng.randint(25, 55)), a=graph.names.word(2),
                            adj=rng.choice(["bold", "restrained", "playful", "austere"]))
                   for f in T["person_filler"]]
        lead_fields = {}
    elif e.type == "work":
        c, year, kind = graph.value(e, "creator"), e.attrs["release_year"], e.kind
        lead = rng.choice(T["work_lead"])
        facts.append((rng.choice(T[f"creator_{kind}"]), {"o": c.mention()}))
        facts.append((rng.choice(T[f"release_{kind}"]), {"y": year}))
        if (pub := graph.value(e, "publisher")) is not None:
            facts.append((rng.choice(T[f"publisher_{kind}"]), {"o": pub.mention()}))
        unit = {"film": ("runs for", "minutes", 80, 190), "novel": ("spans", "pages", 150, 900),
                "album": ("contains", "tracks", 6, 18)}[kind]
        fillers = [f"It {unit[0]} {rng.randint(unit[2], unit[3])} {unit[1]}.",
                   f"The {kind} received {rng.choice(['mixed', 'warm', 'lukewarm', 'glowing'])} reviews.",
                   f"Reviewers singled out its {rng.choice(['pacing', 'imagery', 'ending', 'tone'])}."]
        lead_fields = {"k": kind, "g": e.attrs["genre"]}
    elif e.type == "org":
        lead = rng.choice(T["org_lead"])
        founder, year, hq = graph.value(e, "founder"), e.attrs["founded_year"], graph.value(e, "headquarters")
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
        k = graph.value(e, "country")
        facts.append((rng.choice(T["country"]), {"k": k.mention()}))
        if e.attrs.get("capital_of"):
            facts.append((rng.choice(T["capital_of"]), {"k": k.mention()}))
        fillers = [f"{e.name} has a population of about {e.attrs['population']}.",
                   f"The river {graph.names.word(2)} flows through the city.",
                   "The city is known for its "
                   f"{rng.choice(['markets', 'bridges', 'festivals', 'harbour', 'cathedral'])}."]
        lead_fields = {}
    else:  # country
        lead = rng.choice(T["country_lead"])
        facts.append((rng.choice(T["continent"]), {"k": e.attrs["continent"]}))
        facts.append((rng.choice(T["capital"]), {"c": graph.value(e, "capital").mention()}))
        facts.append((rng.choice(T["leader"]), {"o": graph.value(e, "leader").mention()}))
        fillers = [f"The currency of {e.name} is the {e.attrs['currency']}.",
                   f"{e.name} has about {e.attrs['population_m']} million inhabitants.",
                   f"The official language of {e.name} is {graph.names.word(2)}ic."]
        lead_fields = {"f": e.attrs["official_name"]}

    sentences: list[str] = []
    if lead is not None:
        sentences.append(cap(lead.format(s=e.name, **lead_fields)))
    else:
        t, kw = facts.pop(0)
        sentences.append(fill(t, True, **kw))
    rng.shuffle(facts)
    sentences += [fill(t, False, **kw) for t, kw in facts]
    rng.shuffle(fillers)
    for f in fillers[: rng.randint(0, max_filler)]:
        sentences.insert(rng.randint(1, len(sentences)), cap(f))
    return _articles(" ".join(sentences))


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
