"""Shared fixtures: a synthetic wiki-18 shaped corpus with known answers, the MiniLM encoder,
and one set of indexes built once per session (encoding is the slow part on CPU)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

# (title, text, paraphrased query avoiding the text's key words, code only BM25 can match exactly)
TOPICS = [
    ("Velmora Lighthouse", "A stone tower on a rocky cape whose lamp has guided fishing boats through winter fog "
                           "since 1871.",
     "old coastal beacon that helps fishermen find their way when visibility is poor", "QV-2291"),
    ("Hollin Street Bakery", "A family bakery famous for sourdough loaves raised with a starter culture kept alive "
                             "for more than a century.",
     "shop making bread from a fermentation culture that is over a hundred years old", "BK-3307"),
    ("Mount Cerrovan", "A volcano whose 1652 eruption buried the village at its foot under thick layers of ash.",
     "which mountain exploded and covered a settlement in volcanic dust", "VC-4418"),
    ("Ilse Marquardt", "A chess prodigy who earned the grandmaster title at the age of thirteen.",
     "child who became a top-ranked board game master as a young teenager", "CH-5529"),
    ("Glowing cave beetle", "A beetle species living deep in limestone caves whose abdomen emits a faint blue light.",
     "insect that shines in the dark underground", "BT-6631"),
    ("Tarrow Gorge Bridge", "A suspension bridge whose main span crosses a deep river canyon, the longest of its "
                            "kind when opened.",
     "hanging road crossing over a steep valley with a record length", "BR-7742"),
    ("Nereid probe", "An uncrewed spacecraft that mapped the icy moons of a giant planet and found an ocean beneath "
                     "one crust.",
     "robotic space mission discovering water under frozen satellites", "SP-8853"),
    ("Abbey of Saint Oda", "A medieval monastery where the monks brewed dark ale and aged cheese in the cellars.",
     "religious community of brothers that made beer in the middle ages", "AB-9964"),
    ("Dunmere Rovers", "A football club that won the national league title without losing a single match all season.",
     "soccer team that went unbeaten through a whole championship year", "FC-1075"),
    ("Qasr Nakhil", "A desert oasis town surrounded by groves of date palms and fed by ancient underground channels.",
     "settlement in the sand dunes known for its fruit trees and old water tunnels", "OS-2186"),
    ("Pebble language", "A programming language designed to teach young children to code with picture blocks.",
     "computer coding system for kids that uses images instead of text", "PL-3297"),
    ("Amara Okafor", "A medical researcher who developed the first effective vaccine against malaria.",
     "scientist who created immunization protecting people from a mosquito borne disease", "MD-4308"),
    ("Sapphire Shoals", "A coral reef system where rising sea temperatures caused severe bleaching of the corals.",
     "underwater ecosystem damaged by ocean warming turning white", "RF-5419"),
    ("Kestrel Line", "A high speed railway that links two capital cities in ninety minutes.",
     "fast trains connecting major cities in an hour and a half", "RL-6520"),
    ("The Drowned Mariner", "An opera telling the story of a sailor lost at sea and the wife who waits for him on "
                            "the shore.",
     "musical stage drama about a seaman who vanished in the ocean", "OP-7631"),
    ("Ferrand Glacier", "An alpine ice field that has retreated three kilometres as the climate warmed.",
     "mountain ice mass shrinking because of rising temperatures", "GL-8742"),
    ("Tobias Wrenfield", "A mathematician who proved a long standing conjecture about the spacing of prime numbers.",
     "number theorist who solved an old problem on gaps between primes", "MT-9853"),
    ("Lionel Bracewell", "A jazz saxophonist celebrated for long improvised solos in smoky night clubs.",
     "horn player famous for spontaneous musical performances", "JZ-1964"),
    ("Cyclone Amaru", "A tropical storm that flooded the river delta and displaced hundreds of thousands of people.",
     "hurricane causing floods in a low lying estuary region", "CY-2075"),
    ("Samarqal", "A caravan city on the silk road where merchants traded pepper, saffron and cinnamon.",
     "ancient trading hub along the eastern route for exotic seasonings", "SR-3186"),
    ("Alpine rescue mastiff", "A large mountain dog breed trained to find travellers buried by avalanches.",
     "big canine that searches for people trapped under snow slides", "DG-4297"),
    ("Marta Velikova", "A painter known for portraits of factory workers and coal miners.",
     "artist depicting industrial labourers in her pictures", "PT-5308"),
    ("Atlantic telegraph cable", "An undersea cable that first carried telegraph messages between two continents.",
     "wire laid on the ocean floor for transcontinental communication", "TC-6419"),
    ("Zenith Tower", "A skyscraper that stays steady in earthquakes thanks to a huge tuned mass damper near its top.",
     "tall building designed to resist seismic shaking with a giant pendulum", "SK-7520"),
    ("Library of Pergamos", "An ancient library whose scrolls were destroyed when fire swept through the city.",
     "old book collection lost in a blaze", "LB-8631"),
    ("Abebe Tessema", "A marathon runner who won Olympic gold while running barefoot.",
     "long distance athlete who took first place at the games without shoes", "MR-9742"),
    ("Nuwara estate", "A tea plantation on misty highland slopes producing fine black tea.",
     "farm in the hills growing leaves for a dark brewed beverage", "TE-1853"),
    ("Hedda Lindqvist", "A cryptographer who broke an enemy cipher machine during the war.",
     "codebreaker who cracked secret military messages", "CR-2964"),
    ("Skerry Bank wind farm", "An offshore wind farm whose turbines generate electricity for half a million homes.",
     "sea based turbines producing power for many households", "WF-3075"),
    ("The Clever Fox of Brindle Wood", "A children's novel about a talking fox who outwits the hunters of the forest.",
     "kids book featuring a speaking animal that tricks people chasing it", "NV-4186"),
    ("Decennial orchid", "A rare orchid that flowers only once every ten years in the cloud forest.",
     "plant that blossoms just one time per decade", "OR-5297"),
    ("Wieliska salt mine", "A salt mine with an underground chapel carved entirely out of rock salt.",
     "mine containing a church sculpted underground from mineral crystals", "SM-6308"),
    ("Kourami launch site", "A rocket launch base on a tropical island near the equator.",
     "spaceport located on a warm island close to the equator", "LS-7419"),
    ("Ballet Nouvelle", "A ballet company founded by emigre dancers who fled the revolution.",
     "dance troupe started by refugees escaping political upheaval", "BL-8520"),
    ("Vale of Terraces", "A wine region where grapes grow on stone terraces cut into steep river slopes.",
     "area making wine from vineyards on stepped hillsides", "WN-9631"),
    ("Atacora Observatory", "A telescope high in a dry desert that observes the most distant galaxies.",
     "astronomy facility in an arid place watching faraway star systems", "TS-1742"),
    ("Endurance Drift expedition", "A polar expedition whose ship became trapped in pack ice for two winters.",
     "arctic journey where the vessel got stuck in frozen sea", "PX-2853"),
    ("Mirren Dam", "A hydroelectric dam whose reservoir flooded a valley and forced several villages to move.",
     "barrier on a river generating power that displaced communities", "DM-3964"),
    ("Anselm Kreutz", "An inventor who built one of the first mechanical calculators using gears and dials.",
     "person who created an early arithmetic machine with cogs", "IN-4075"),
    ("Gullwing Regatta", "An annual sailing race in which yachts circle the island over three days.",
     "yearly boat competition around an island", "RG-5186"),
]

_TOWNS = ["Ashby", "Brenford", "Calder", "Dunholm", "Elmstead", "Farrow", "Glenmoor", "Harwick", "Ivybridge",
          "Kelham", "Langley", "Morcott", "Norbury", "Oakhurst", "Pelham", "Redbourne"]
_MATTERS = ["pothole repairs", "parking permits", "street lighting budget", "waste collection days",
            "allotment rents", "hedge trimming", "school crossing patrol", "bus shelter paint",
            "dog fouling signs", "verge mowing schedule"]
_GOODS = ["kettle", "toaster", "desk lamp", "umbrella", "water bottle", "stapler", "door mat", "coat hanger",
          "pencil case", "ironing board", "shoe rack", "bath towel"]
_COLOURS = ["red", "grey", "beige", "navy", "olive", "white", "black", "teal"]


def make_rows(n_filler: int = 600, seed: int = 0) -> list[dict]:
    """TOPICS plus mundane filler (council minutes, product listings) with 5-digit numbers only."""
    rng = random.Random(seed)
    rows = [{"id": f"topic-{i}", "contents": f'"{t}"\n{text} Registry code {code}.'}
            for i, (t, text, _, code) in enumerate(TOPICS)]
    for j in range(n_filler):
        if j % 2:
            title = f"{rng.choice(_TOWNS)} council minutes {rng.randint(10000, 99999)}"
            text = f"The council discussed {rng.choice(_MATTERS)} and agreed to revisit it next month."
        else:
            title = f"{rng.choice(_COLOURS).title()} {rng.choice(_GOODS)} {rng.randint(10000, 99999)}"
            text = f"A {rng.choice(_COLOURS)} {rng.choice(_GOODS)} sold in packs of {rng.randint(2, 9)}."
        rows.append({"id": f"filler-{j}", "contents": f'"{title}"\n{text}'})
    rng.shuffle(rows)  # topic rows are not simply the first rows
    return rows


def write_corpus(path: Path, rows: list[dict], blank_lines: bool = True) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_lines:  # the doc store must skip blank lines like every jsonl reader
        lines.insert(len(lines) // 2, "   ")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_rows() -> list[dict]:
    return make_rows()


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory, corpus_rows) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", corpus_rows)


@pytest.fixture(scope="session")
def encoder():
    from services.retriever.encoders import Encoder, EncoderConfig

    return Encoder(EncoderConfig())


SHARD = 128  # 640 docs -> 5 shards


@pytest.fixture(scope="session")
def index_root(tmp_path_factory, corpus_path, encoder) -> Path:
    """docstore + dense (flat) + dense-hnsw + dense-ivfpq + bm25; the variants reuse dense/'s shards."""
    from services.retriever.indexing import DenseIndexConfig, build_all, build_dense_index

    root = tmp_path_factory.mktemp("indexes")
    build_all(corpus_path, root, DenseIndexConfig(shard_size=SHARD), encoder=encoder)
    for kind in ("hnsw", "ivfpq"):
        shutil.copytree(root / "dense" / "emb", root / f"dense-{kind}" / "emb")
        build_dense_index(corpus_path, root / f"dense-{kind}", DenseIndexConfig(shard_size=SHARD, faiss_type=kind),
                          encoder=encoder)
    return root


@pytest.fixture(scope="session")
def engine(index_root, encoder):
    from services.retriever.engine import RetrievalEngine

    return RetrievalEngine.from_dir(index_root, encoder=encoder)


def topic_ids() -> list[str]:
    return [f"topic-{i}" for i in range(len(TOPICS))]


def paraphrases() -> list[str]:
    return [t[2] for t in TOPICS]


def codes() -> list[str]:
    return [t[3] for t in TOPICS]
