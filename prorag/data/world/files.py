"""A world's folder: written from the generated world (atomically, ``DONE`` last), reused when finished, summarised,
and extended with deep splits."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prorag.config import from_dict, to_dict
from prorag.data.world.config import (DEEP_SPLIT, DEEP_SPLITS, DEV_DEEP_SPLIT, HELDOUT_DEEP_SPLIT, SPLITS, WORLD_VERSION,
                                      WorldConfig)
from prorag.data.world.generate import generate_deep_split, generate_deep_splits, generate_world
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


def ensure_deep_split(out_dir: str | Path, n: int, split: str = "test") -> Path:
    """``{out_dir}/test_deep.jsonl`` with ``n`` questions of 3+ hops (:func:`generate_deep_split`) for a finished
    world, written once (atomically) and reused. The world is regenerated in memory from its recorded config;
    if that does not reproduce its splits on disk (built by another generator version), nothing is written
    and FailedPrecondition says to rebuild it.

    ``split="dev"``: ``dev_deep.jsonl``, ``n`` questions drawn after the test deep split (as many as are on disk,
    or ``n`` when there is none yet, then written too), so that no dev question is a test one. A test deep split
    rewritten with another size invalidates the dev one, which is drawn again on its next use."""
    from prorag.errors import InvalidArgument

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
    _check_reproduced(out_dir, cfg, w, DEEP_SPLITS[split])
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


def _check_reproduced(out_dir: Path, cfg: WorldConfig, w: dict, adding: str) -> None:
    """FailedPrecondition unless the world regenerated in memory (``w``) has the splits on disk: an extra split
    drawn after them is disjoint from them only if the generator still makes them."""
    from prorag.errors import FailedPrecondition  # here: prorag.errors imports grpc, which world generation does not need

    for s in SPLITS:
        on_disk = [(r["id"], r["question"]) for r in read_jsonl(out_dir / f"{s}.jsonl")]
        if on_disk != [(r["id"], r["question"]) for r in w["splits"][s]]:
            raise FailedPrecondition(f"{out_dir}: its {s} split is not what this generator makes from the world's "
                                     f"config (built by another version): rebuild it (`prorag world --name "
                                     f"{cfg.name} --force`) to add the {adding} split")


def ensure_heldout_split(out_dir: str | Path, n: int, test_n: int, dev_n: int) -> Path:
    """``{out_dir}/heldout_deep.jsonl``: ``n`` questions of 3+ hops drawn after the test deep split and the dev deep
    split (:func:`prorag.data.world.generate.generate_deep_splits`), so it shares no chain or question with any
    split of the world: the test of issue 47, read once at the end. Written once (atomically) and reused.

    The deep splits it is drawn after are those on disk; one that is missing is drawn first, with ``test_n`` /
    ``dev_n`` questions, and written too, so that a deep split made later can never overlap it. The sizes it was
    drawn after are recorded beside it (``heldout_deep.after``): if either deep split is redrawn with another size,
    the held-out split is drawn again after them (and was then not read once)."""
    from prorag.errors import InvalidArgument  # here: as above (grpc)

    if n < 1 or test_n < 1 or dev_n < 1:
        raise InvalidArgument(f"held-out split: n, test_n and dev_n are at least 1; got {n}, {test_n}, {dev_n}")
    out_dir = Path(out_dir)
    if not (out_dir / "DONE").exists():
        raise FileNotFoundError(f"{out_dir}: no finished world (DONE missing); run `prorag world`")
    test_path, dev_path = out_dir / f"{DEEP_SPLIT}.jsonl", out_dir / f"{DEV_DEEP_SPLIT}.jsonl"
    path, after = out_dir / f"{HELDOUT_DEEP_SPLIT}.jsonl", out_dir / f"{HELDOUT_DEEP_SPLIT}.after"
    dev_after = out_dir / f"{DEV_DEEP_SPLIT}.after"
    test_n = sum(1 for _ in read_jsonl(test_path)) if test_path.exists() else test_n
    # a dev deep split drawn after a test one of another size (ensure_deep_split redraws it when next asked): drawn
    # here again, after the test one on disk
    dev_current = dev_path.exists() and dev_after.exists() and dev_after.read_text().strip() == str(test_n)
    dev_n = sum(1 for _ in read_jsonl(dev_path)) if dev_current else dev_n
    record = f"{test_n} {dev_n}"
    if (path.exists() and after.exists() and after.read_text().strip() == record and dev_current
            and sum(1 for _ in read_jsonl(path)) == n):
        return path
    meta = json.loads((out_dir / "world.json").read_text())
    cfg = from_dict(WorldConfig, meta["config"])
    w, drawn = generate_deep_splits(cfg, [(DEEP_SPLIT, test_n), (DEV_DEEP_SPLIT, dev_n), (HELDOUT_DEEP_SPLIT, n)])
    _check_reproduced(out_dir, cfg, w, HELDOUT_DEEP_SPLIT)
    if not test_path.exists():
        write_jsonl(test_path, drawn[DEEP_SPLIT])
    if not dev_current:
        write_jsonl(dev_path, drawn[DEV_DEEP_SPLIT])
        write_text(dev_after, f"{test_n}\n")
    write_jsonl(path, drawn[HELDOUT_DEEP_SPLIT])
    write_text(after, record + "\n")
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
