"""Invented names (pronounceable, unique by normalised form) and the casing of generated text.

Everything here is invented or generic English so no fact is about a real entity.
"""

from __future__ import annotations

import random
from typing import Callable

from prorag.metrics import normalize_answer

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "w", "z", "th", "sh", "j", "kr", "fl"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "a", "e", "ai", "ea", "y"]
_MID_CODAS = ["n", "r", "l", "s", "m"]  # a closed inner syllable: Tor-van, Kes-sa-ro
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "nd", "rn", "st", "th", "x", "sk", "ld", "rk"]
_SURNAME_END = ["", "", "", "by", "son", "ard", "ell", "wick", "ley", "mont", "stad"]
_CITY_END = ["", "", "", "", "mouth", "ford", "holm", "burg", "ton", "vale", "wick", "haven"]
_CITY_PRE = ["Port ", "Upper ", "East ", "West ", "Old "]
_COUNTRY_END = ["ia", "a", "or", "and", "ar", "ine", "", "", "istan"]
_CONTINENT_END = ["ia", "a", "ea"]

_ADJ = ["Red", "Silent", "Hollow", "Golden", "Last", "Broken", "Northern", "Winter", "Quiet", "Burning",
        "Distant", "Iron", "Paper", "Glass", "Crimson", "Lonely", "Secret", "Endless", "Pale", "Wild", "Bitter",
        "Velvet", "Silver", "Drowned", "Sleeping", "Forgotten", "Bright", "Shallow", "Wandering", "Hidden",
        "Amber", "Falling", "Little", "Savage", "Gentle", "Restless", "Scarlet", "Frozen", "Open", "Narrow"]
_NOUN = ["Harbour", "Garden", "River", "Lantern", "Crown", "Mirror", "Orchard", "Tide", "Bridge", "Meadow",
         "Tower", "Letter", "Island", "Season", "Kingdom", "Engine", "Compass", "Window", "Shore", "Forest",
         "Carnival", "Voyage", "Station", "Feather", "Harvest", "Signal", "Horizon", "Archive", "Fountain",
         "Summer", "Storm", "Ember", "Valley", "Citadel", "Echo", "Orbit", "Ledger", "Canyon", "Parade", "Hymn"]
_NO_NAME_TOKENS = {"a", "an", "the", "yes", "no", "noanswer"}


def cap(s: str) -> str:
    """First letter upper-cased: sentences and questions often open on a template's slot."""
    return s[:1].upper() + s[1:]


class Names:
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
        return cap("".join(parts))

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
