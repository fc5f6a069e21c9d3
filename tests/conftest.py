"""Shared fixtures: environment for offline runs, and a tiny random Qwen3 policy with a tokenizer trained on
synthetic format text (built once per session) for model, rollout and service tests."""

import os

import prorag_app  # noqa: F401,E402  (its gRPC fork setting, before any test module imports grpc)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import contextlib
import random

import pytest

from prorag import trajectory as T
from prorag.data.loaders import Document

WORDS = ("the of and in was is for on as by with he at from his an were are which this also be has "
         "had first one their its new after who they two her she been other when there all during into "
         "school time may years more most only over city world would where later film river born director "
         "capital country president founded album band song river mountain university").split()


class VocabOnly:
    """Only what build_model reads from a tokenizer: a size and the special ids."""

    eos_token_id, pad_token_id = 2, 0

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def convert_tokens_to_ids(self, t):
        return 1


def synthetic_texts(n: int = 300, seed: int = 0) -> list[str]:
    """Sentences plus rendered trajectories, so the BPE sees the glue around the tags."""
    rng = random.Random(seed)

    def sent(k):
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize()

    out = []
    for i in range(n):
        if i % 3:
            out.append(sent(rng.randint(5, 20)) + ".")
        else:
            steps = [T.Step("subquery", sent(6) + ".", sent(4) + "?",
                            docs=[Document.from_parts("", sent(2), sent(12)) for _ in range(3)]),
                     T.Step("subanswer", sent(5) + ".", sent(2)), T.Step("answer", sent(4) + ".", sent(2))]
            out.append(T.render_trajectory(sent(8) + "?", steps))
    return out


@contextlib.contextmanager
def single_thread():
    """Tiny models gain nothing from 2 threads, and OpenMP's spin-waiting makes them 5-10x slower
    whenever another process shares the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    """(model_dir, tokenizer): a saved tiny model (max 512 positions) loadable by TransformersEngine."""
    from prorag.modeling import PolicyModelConfig, build_model, save_pretrained, train_tokenizer

    root = tmp_path_factory.mktemp("policy")
    tok = train_tokenizer(synthetic_texts(), vocab_size=1024, out_dir=root / "tokenizer")
    cfg = PolicyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, max_position_embeddings=512)
    model = build_model(cfg, tok, seed=0)
    save_pretrained(model, tok, root / "model")
    return root / "model", tok




# ---------------------------------------------------------------- running beside another worker (`make test`: -n 2)

#: modules that take longest (CI's --durations), slowest first. They are started first, so the end-to-end test
#: (~400 s alone) does not start last on one worker while the other idles; the rest keep their collection order.
SLOW_FIRST = (
    "tests/app/test_end_to_end.py",
    "tests/training/test_distributed.py",
    "tests/services/trainer/test_service_faults.py",
    "tests/app/test_cli_up.py",
    "tests/services/trainer/test_sft_stage.py",
    "tests/services/trainer/test_rl_stage.py",
    "tests/app/test_check_gpu.py",
)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        # two workers on two cores: torch's default of a thread per core in each would make four threads fight
        # for two cores (tests that want more threads set their own; service processes keep the default)
        torch.set_num_threads(1)


def _module_scoped(item) -> bool:
    """Whether the test uses a fixture set up once per module or class (a server, a trained model): such a
    module's tests go to one worker together, or each worker would set the fixture up again."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info else ()
    # (package-scoped fixtures are set up once per package on each worker whatever the grouping)
    return any(str(d.scope).split(".")[-1].lower() in ("module", "class")
               and d.argname != "one_thread" for ds in defs for d in ds)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    # a stable sort keeps each module's tests together and in order (module fixtures are set up once)
    items.sort(key=lambda item: rank.get(module(item), len(rank)))
    grouped = {id(item) for item in items if _module_scoped(item)}
    for item in items:
        if id(item) in grouped:
            item.add_marker(pytest.mark.xdist_group(module(item)))
    # xdist (loadgroup) hands each worker two units at the start and gives it more only as tests finish: the second
    # unit of the first worker waits behind the whole end-to-end test. Make that third unit overall one quick test
    # (the first outside the slow modules) instead of the next slow module.
    units = []  # the first item of each unit, in order: a group is one unit, any other test is one
    seen = set()
    for i, item in enumerate(items):
        key = module(item) if id(item) in grouped else item.nodeid
        if key not in seen:
            seen.add(key)
            units.append(i)
    quick = next((i for i, item in enumerate(items) if module(item) not in rank and id(item) not in grouped), None)
    if len(units) > 2 and quick is not None:
        items.insert(units[2], items.pop(quick))
