"""A world's folder: written from the generated world (atomically, ``DONE`` last), reused when finished, summarised,
and extended with the 3+ hop splits drawn after train (test deep, dev deep, held-out, RL)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prorag.config import from_dict, to_dict
from prorag.data.world.config import (DEEP_SPLIT, DEEP_SPLITS, DEV_DEEP_SPLIT, DRAWN_SPLITS, HELDOUT_DEEP_SPLIT,
                                      RL_SPLIT, RL_SPLITS, SPLITS, WORLD_VERSION, WorldConfig)
from prorag.data.world.generate import generate_drawn_splits, generate_world
from prorag.io import read_jsonl, write_json, write_jsonl, write_text


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


def ensure_drawn_split(out_dir: str | Path, name: str, n: int, sizes: dict[str, int]) -> Path:
    """``{out_dir}/{name}.jsonl``: ``n`` questions of 3+ hops (of every category for :data:`MIXED_SPLITS`), one of
    the extra splits a finished world is extended with (:data:`DRAWN_SPLITS`: test deep, dev deep, held-out, RL, mixed
    RL, in that order). Each is drawn after the ones before it (:func:`prorag.data.world.generate_drawn_splits`), so
    it shares no chain or question with them or with the world's own splits. Written once (atomically) and reused.

    Every split but the first records the sizes of those it was drawn after (``{name}.after``, e.g. ``450 450`` for
    the held-out one). A split before ``name`` that is on disk and current (its record matches the splits before it,
    which are current too) keeps its size; one that is missing or stale is drawn with ``sizes[its name]`` and
    written too, so that no split drawn later can overlap the one asked for. A split whose predecessors were redrawn
    with other sizes is therefore drawn again when next asked for (and was then not read once). The world is
    regenerated in memory from its recorded config; if that does not reproduce its splits on disk (built by another
    generator version), nothing is written and FailedPrecondition says to rebuild it."""
    from prorag.errors import InvalidArgument  # here: prorag.errors imports grpc, which world generation does not need

    if name not in DRAWN_SPLITS:
        raise InvalidArgument(f"no drawn split {name!r}: one of {list(DRAWN_SPLITS)}")
    chain = DRAWN_SPLITS[:DRAWN_SPLITS.index(name) + 1]
    if n < 1:
        raise InvalidArgument(f"the {name} split: n is at least 1; got {n}")
    out_dir = Path(out_dir)
    if not (out_dir / "DONE").exists():
        raise FileNotFoundError(f"{out_dir}: no finished world (DONE missing); run `prorag world`")
    drawn: list[tuple[str, int]] = []  # (split, size) in drawing order
    stale: list[str] = []  # splits before ``name`` to write
    for split in chain[:-1]:
        path = out_dir / f"{split}.jsonl"
        if not stale and path.exists() and _drawn_after(out_dir, split) == [k for _, k in drawn]:
            drawn.append((split, sum(1 for _ in read_jsonl(path))))
            continue
        size = sizes.get(split, 0)
        if size < 1:
            raise InvalidArgument(f"the {name} split is drawn after the {split} split, which is "
                                  f"{'stale' if path.exists() else 'missing'}: give its size (at least 1)")
        stale.append(split)
        drawn.append((split, size))
    path = out_dir / f"{name}.jsonl"
    if (not stale and path.exists() and _drawn_after(out_dir, name) == [k for _, k in drawn]
            and sum(1 for _ in read_jsonl(path)) == n):
        return path
    meta = json.loads((out_dir / "world.json").read_text())
    cfg = from_dict(WorldConfig, meta["config"])
    w, rows = generate_drawn_splits(cfg, drawn + [(name, n)])
    _check_reproduced(out_dir, cfg, w, name)
    for i, (split, _) in enumerate(drawn + [(name, n)]):
        if split in stale or split == name:
            write_jsonl(out_dir / f"{split}.jsonl", rows[split])
            if i:
                write_text(out_dir / f"{split}.after", " ".join(str(k) for _, k in drawn[:i]) + "\n")
    return path


def _drawn_after(out_dir: Path, split: str) -> list[int] | None:
    """The sizes ``split`` records it was drawn after ([] for the first of DRAWN_SPLITS); None without a record."""
    if split == DRAWN_SPLITS[0]:
        return []
    after = out_dir / f"{split}.after"
    return [int(k) for k in after.read_text().split()] if after.exists() else None


def ensure_deep_split(out_dir: str | Path, n: int, split: str = "test", test_n: int = 0) -> Path:
    """``{out_dir}/test_deep.jsonl`` with ``n`` questions of 3+ hops for a finished world (:func:`ensure_drawn_split`).
    ``split="dev"``: ``dev_deep.jsonl``, drawn after the test deep split (as many questions as are on disk, or
    ``test_n`` when there is none yet, then written too), so that no dev question is a test one.

    test_n is the size the test deep split will be read at, not the dev one's: a test split drawn at the dev size
    is redrawn when a test run asks for its own size, and that redraws the dev split (and every split drawn after
    it, the RL one among them) under the same ids, so dev figures measured before no longer name its questions."""
    from prorag.errors import InvalidArgument  # here: as above (grpc)

    if split not in DEEP_SPLITS:
        raise InvalidArgument(f"no deep split for {split!r}: one of {sorted(DEEP_SPLITS)}")
    return ensure_drawn_split(out_dir, DEEP_SPLITS[split], n, {DEEP_SPLIT: n if split == "test" else test_n})


def _check_reproduced(out_dir: Path, cfg: WorldConfig, w: dict, adding: str) -> None:
    """FailedPrecondition unless the world regenerated in memory (``w``) has the splits on disk: an extra split
    drawn after them is disjoint from them only if the generator still makes them."""
    # here: prorag.errors imports grpc, which world generation does not need
    from prorag.errors import FailedPrecondition

    for s in SPLITS:
        on_disk = [(r["id"], r["question"]) for r in read_jsonl(out_dir / f"{s}.jsonl")]
        if on_disk != [(r["id"], r["question"]) for r in w["splits"][s]]:
            raise FailedPrecondition(f"{out_dir}: its {s} split is not what this generator makes from the world's "
                                     f"config (built by another version): rebuild it (`prorag world --name "
                                     f"{cfg.name} --force`) to add the {adding} split")


def ensure_heldout_split(out_dir: str | Path, n: int, test_n: int, dev_n: int) -> Path:
    """``{out_dir}/heldout_deep.jsonl``: ``n`` questions of 3+ hops drawn after the test and dev deep splits
    (:func:`ensure_drawn_split`; a missing one drawn with ``test_n`` / ``dev_n`` questions), so it shares no chain or
    question with any split of the world: the test of issue 47, read once at the end."""
    from prorag.errors import InvalidArgument  # here: as above (grpc)

    if n < 1 or test_n < 1 or dev_n < 1:
        raise InvalidArgument(f"held-out split: n, test_n and dev_n are at least 1; got {n}, {test_n}, {dev_n}")
    return ensure_drawn_split(out_dir, HELDOUT_DEEP_SPLIT, n, {DEEP_SPLIT: test_n, DEV_DEEP_SPLIT: dev_n})


def ensure_rl_split(out_dir: str | Path, n: int, test_n: int, dev_n: int, heldout_n: int, split: str = RL_SPLIT,
                    rl_deep_n: int = 0) -> Path:
    """``{out_dir}/{split}.jsonl``: ``n`` questions for RL's question pool, drawn after the test deep, dev deep and
    held-out splits (:func:`ensure_drawn_split`; a missing one drawn with its size given here), so the RL trains on
    questions that neither SFT (train) nor any evaluation reads. ``split``: :data:`RL_SPLIT` (3+ hops) or
    :data:`RL_MIXED_SPLIT` (every category), which is drawn after the first (``rl_deep_n`` questions when missing)."""
    from prorag.errors import InvalidArgument  # here: as above (grpc)

    if split not in RL_SPLITS:
        raise InvalidArgument(f"no RL split {split!r}: one of {list(RL_SPLITS)}")
    return ensure_drawn_split(out_dir, split, n, {DEEP_SPLIT: test_n, DEV_DEEP_SPLIT: dev_n,
                                                  HELDOUT_DEEP_SPLIT: heldout_n, RL_SPLIT: rl_deep_n})


def load_summary(out_dir: str | Path) -> dict:
    """The summary (as a dict) of a finished world folder, without rebuilding anything."""
    out_dir = Path(out_dir)
    if not (out_dir / "DONE").exists():
        raise FileNotFoundError(f"{out_dir}: no finished world (DONE missing); run `prorag world`")
    meta = json.loads((out_dir / "world.json").read_text())
    cfg = from_dict(WorldConfig, meta["config"])
    splits = {s: list(read_jsonl(out_dir / f"{s}.jsonl")) for s in SPLITS}
    return _summary(cfg, out_dir, splits, meta["counts"]["entities"], 0.0, True).to_dict()


def entity_relations(out_dir: str | Path) -> dict[str, tuple[str, frozenset]]:
    """document id -> (its entity's kind, the relations and attributes it has) of a finished world folder, e.g.
    ``{"C00001": ("city", frozenset({"country", "population", "capital_of"}))}``; {} for a folder that is not a
    generated world (a corpus imported in the FlashRAG layout has no world.json)."""
    path = Path(out_dir) / "world.json"
    if not path.exists():
        return {}
    return {e["id"]: (e["kind"], frozenset([*e.get("rels", {}), *e.get("attrs", {})]))
            for e in json.loads(path.read_text())["entities"]}


def _check_disjoint(splits: dict[str, list[dict]]) -> None:
    """No dev/test chain or question text may occur in train (guaranteed by construction; checked anyway)."""
    train_chains = {r["metadata"]["chain"] for r in splits["train"]}
    train_text = {r["question"] for r in splits["train"]}
    for s in ("dev", "test"):
        for r in splits[s]:
            if r["metadata"]["chain"] in train_chains or r["question"] in train_text:
                raise AssertionError(f"{s} question {r['id']} leaks into train")
