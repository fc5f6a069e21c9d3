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

Modules: ``config`` (WorldConfig, size presets, split names), ``names`` (invented names), ``graph`` (entities and
their relations), ``documents`` (one per entity), ``questions`` (questions with their decompositions, their
phrasings, :func:`canonical_question`), ``generate`` (the world and its splits in memory), ``files`` (the folder:
:func:`build_world`, the splits drawn after train, summaries).
"""

from prorag.data.world.config import (CATEGORIES, DEEP_SPLIT, DEEP_SPLITS, DEV_DEEP_SPLIT, DRAWN_SPLITS,
                                      HELDOUT_DEEP_SPLIT, MIXED_SPLITS, RL_MIXED_SPLIT, RL_SPLIT, RL_SPLITS,
                                      SIZES, SPLITS, TEST_SPLITS, WORLD_VERSION, WorldConfig)
from prorag.data.world.files import (WorldSummary, build_world, ensure_deep_split, ensure_drawn_split,
                                     ensure_heldout_split, ensure_rl_split, load_summary)
from prorag.data.world.generate import generate_deep_split, generate_drawn_splits, generate_world
from prorag.data.world.questions import canonical_question

__all__ = ["CATEGORIES", "DEEP_SPLIT", "DEEP_SPLITS", "DEV_DEEP_SPLIT", "DRAWN_SPLITS", "HELDOUT_DEEP_SPLIT",
           "MIXED_SPLITS", "RL_MIXED_SPLIT", "RL_SPLIT", "RL_SPLITS", "SIZES", "SPLITS", "TEST_SPLITS",
           "WORLD_VERSION", "WorldConfig", "WorldSummary",
           "build_world", "canonical_question", "ensure_deep_split", "ensure_drawn_split", "ensure_heldout_split",
           "ensure_rl_split", "generate_deep_split", "generate_drawn_splits",
           "generate_world", "load_summary"]
