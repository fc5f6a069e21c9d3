"""A world's configuration, its size presets and the names of its question categories and splits."""

from __future__ import annotations

from dataclasses import dataclass

from prorag.config import ConfigError, cfg_field

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
#: a held-out test split of 3+ hop questions (issue 47), drawn after the test and dev deep splits and disjoint from
#: both: read once, at the end of an experiment whose choices were made on dev
HELDOUT_DEEP_SPLIT = "heldout_deep"
#: 3+ hop questions held out of SFT for RL's question pool (issue 47 item 3): drawn after the held-out split, so the
#: RL trains on questions the SFT agent never saw and no evaluation reads
RL_SPLIT = "rl_deep"
#: questions of every category in the world's mix (1-4 hops, comparisons) held out of SFT, for an RL pool that
#: also asks 1- and 2-hop questions: a pool of 3+ hop questions alone taught the agent to search a third time on
#: 2-hop ones (docs/BENCHMARKS.md, "Fifty-first session"). Drawn after the RL split, so no earlier split changes
RL_MIXED_SPLIT = "rl_mixed"
#: the splits a question pool and the RL may draw on besides train: questions SFT never saw
RL_SPLITS = (RL_SPLIT, RL_MIXED_SPLIT)
#: the extra splits in the order they are drawn after train (prorag.data.world.files.ensure_drawn_split): each
#: shares no chain or question with any split before it, and is the same whatever is drawn after it. All hold 3+
#: hop questions but those in MIXED_SPLITS, which follow the world's category mix
DRAWN_SPLITS = (DEEP_SPLIT, DEV_DEEP_SPLIT, HELDOUT_DEEP_SPLIT, RL_SPLIT, RL_MIXED_SPLIT)
MIXED_SPLITS = (RL_MIXED_SPLIT,)
#: the splits the final figures are read on, which no training or search stage may sample
TEST_SPLITS = ("test", DEEP_SPLIT, HELDOUT_DEEP_SPLIT)


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

