"""The run profiles of `prorag run` and the multi-run plans over them, as typed data.

A profile's settings name its training jobs (prorag_app.pipeline.job_id_for hashes them), so changing a value
trains anew. Each choice carries a one-line reason; the measurements behind them are in docs/BENCHMARKS.md.
Every profile is checked against the trainer's job configs when it is defined, so this module imports them
(and torch with them); the stage runners read these settings and are never imported here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from prorag.config import check_fields
from prorag.data.world.config import RL_MIXED_SPLIT, RL_SPLIT, RL_SPLITS
from prorag.errors import InvalidArgument
from prorag.methods import base_method, get_method
from prorag.modeling import WarmupConfig
from prorag.search.mcts import MCTSConfig
from prorag_app.embedded import BASE_SOURCES
from prorag_app.stage_settings import Stage2Settings, Stage34Settings
from services.trainer.stage_dpo import DPOConfig
from services.trainer.stage_mcts import MCTSStageConfig
from services.trainer.stage_prm import PRMConfig
from services.trainer.stage_rft import RFTConfig
from services.trainer.stage_rl import RLConfig
from services.trainer.stage_rlpool import RLPoolConfig
from services.trainer.stage_sft import SFTConfig
from services.trainer.stage_siblings import SiblingsStageConfig


@dataclass(frozen=True)
class Profile:
    """What `make run` trains and evaluates; `tiny` is what the end-to-end test runs.

    Typed: at definition every method must be in the method table, every SFT setting a valid SFTConfig
    field and value, every warm-up setting a valid WarmupConfig one, so a typo fails at import, not an
    hour into a run."""

    world: str
    model_preset: str
    vocab_size: int
    sft: dict                      # SFT job settings shared by the policy and the baselines
    eval_questions: int = 0        # 0 = the whole test split
    methods: tuple[str, ...] = ("no_retrieval", "standard_rag", "sft")
    base_warmup: dict | None = None  # base warm-up (WarmupConfig overrides); None = the world's default base
    base_variant: str = ""           # directory suffix of a base other than the world's default
    #: where a missing base comes from (prorag_app.embedded.BASE_SOURCES): "shipped" installs the base shipped for
    #: the world when it is the one these settings build, else warms one up; "build" always warms one up here
    base_source: str = "shipped"
    method_sft: dict = field(default_factory=dict)  # {method: SFT settings on top of ``sft`` for that method only}
    stage2: dict | None = None  # MCTS, judging, PRM and its validation (stage_settings.Stage2Settings); None = off
    stage34: dict | None = None  # RFT, ProRAG's RL and outcome-only GRPO (stage_settings.Stage34Settings)
    #: questions of the world's extra 3+ hop split (prorag.data.world.ensure_deep_split) on which the SFT agent
    #: and the stage 3-4 methods are also evaluated, so their paired comparisons see enough deep questions
    deep_questions: int = 0
    #: questions of the dev deep split a dev run evaluates on, and that the held-out split is drawn after when the
    #: world has none yet (0 = deep_questions)
    dev_deep_questions: int = 0
    #: questions of the world's held-out 3+ hop split (prorag.data.world.ensure_heldout_split: drawn after the test
    #: and dev deep splits, disjoint from every split), on which the SFT agent and the stage 3-4 methods are also
    #: evaluated and compared, apart, in test runs only (issue 47: read once, at the end); 0 = none
    heldout_questions: int = 0
    #: questions of the world's RL split that stage34.rl.split names (prorag.data.world.ensure_rl_split: rl_deep, 3+
    #: hops held out of SFT, drawn after the held-out split; or rl_mixed, every category, drawn after rl_deep): the
    #: question pool and the RL draw from questions the SFT agent never saw; 0 = none (the RL draws from train)
    rl_questions: int = 0
    #: the split methods are evaluated and compared on: test for reported figures, dev for choosing settings
    #: (`prorag run --split dev`, with the dev deep split: drawn after the test one, sharing no question with it)
    eval_split: str = "test"

    def __post_init__(self) -> None:
        if self.base_source not in BASE_SOURCES:
            raise InvalidArgument(f"base_source {self.base_source!r}: expected one of {', '.join(BASE_SOURCES)}")
        for m in self.methods:
            method = get_method(m)
            if method.reader and method.reader not in self.methods:
                raise InvalidArgument(f"profile method {m!r} reads with {method.reader!r}'s model: list "
                                      f"{method.reader!r} in the profile's methods too")
        for m in (*(m for m in self.methods if not get_method(m).reader), *self.method_sft):
            if get_method(m).stage != "sft":
                what = (f"reads with {get_method(m).reader!r}'s model and is not trained" if get_method(m).reader
                        else f"is trained by stage {get_method(m).stage!r}")
                raise InvalidArgument(f"profile method {m!r} {what}, not SFT: stages 3-4 are asked for by the "
                                      "profile's stage34 settings")
        if self.eval_split not in ("test", "dev"):
            raise InvalidArgument(f"eval_split: {self.eval_split!r} is not test or dev")
        if self.heldout_questions and not self.deep_questions:
            raise InvalidArgument("heldout_questions: the held-out split is drawn after the test deep split; set "
                                  "deep_questions too")
        rl = (self.stage34 or {}).get("rl", {})
        rl_split = rl.get("split", "train")
        if self.stage34 is not None and (rl_split in RL_SPLITS) != bool(self.rl_questions):
            raise InvalidArgument(f"rl_questions sizes the RL split ({' or '.join(RL_SPLITS)}) that stage34.rl.split "
                                  f"names: set both, or neither (rl_questions {self.rl_questions}, stage34.rl.split "
                                  f"{rl_split!r})")
        if rl_split == RL_MIXED_SPLIT and rl.get("min_hops", 0) >= 3:
            raise InvalidArgument(f"stage34.rl.split {RL_MIXED_SPLIT!r} with min_hops {rl['min_hops']} keeps only its "
                                  f"3+ hop questions: set stage34.rl.min_hops=0 to draw on every hop count, or "
                                  f"split {RL_SPLIT!r}")
        if rl.get("pool_max_greedy_f1", 1.0) < 1.0 and \
                not (self.stage34 or {}).get("pool", {}).get("greedy"):
            raise InvalidArgument("stage34.rl.pool_max_greedy_f1 selects on the pool's greedy rollouts: set "
                                  "stage34.pool.greedy=true too")
        if self.rl_questions and not self.deep_questions:
            raise InvalidArgument(f"rl_questions: the {rl_split} split is drawn after the deep and held-out splits; "
                                  "set deep_questions too")
        check_fields(SFTConfig, self.sft, prefix="sft.")
        for m, settings in self.method_sft.items():
            check_fields(SFTConfig, settings, prefix=f"method_sft.{m}.")
        if self.base_warmup is not None:
            check_fields(WarmupConfig, self.base_warmup, prefix="base_warmup.")
        if self.stage2 is not None:
            check_fields(Stage2Settings, {k: v for k, v in self.stage2.items()
                                          if k not in ("mcts", "prm", "siblings")}, prefix="stage2.")
            check_fields(SiblingsStageConfig, self.stage2.get("siblings", {}), prefix="stage2.siblings.")
            mcts = dict(self.stage2.get("mcts", {}))
            check_fields(MCTSConfig, mcts.pop("mcts", {}), prefix="stage2.mcts.mcts.")
            check_fields(MCTSStageConfig, mcts, prefix="stage2.mcts.")
            check_fields(PRMConfig, self.stage2.get("prm", {}), prefix="stage2.prm.")
        if self.stage34 is not None:
            check_fields(Stage34Settings, {k: v for k, v in self.stage34.items()
                                           if k not in ("rft", "rl", "dpo", "pool")}, prefix="stage34.")
            check_fields(RLPoolConfig, self.stage34.get("pool", {}), prefix="stage34.pool.")
            for m in (*self.stage34.get("methods", ()), *self.stage34.get("left_out", {})):
                if get_method(m).stage not in ("rft", "rl", "dpo"):
                    raise InvalidArgument(f"stage34.methods or left_out: {m!r} is not a stage 3-4 method")
            check_fields(RFTConfig, self.stage34.get("rft", {}), prefix="stage34.rft.")
            check_fields(RLConfig, self.stage34.get("rl", {}), prefix="stage34.rl.")
            check_fields(DPOConfig, self.stage34.get("dpo", {}), prefix="stage34.dpo.")

    @property
    def trained_methods(self) -> tuple[str, ...]:
        """The methods the SFT stage trains (the others read with one of these models)."""
        return tuple(m for m in self.methods if get_method(m).stage == "sft")

    def model_of(self, method: str) -> str:
        """The trained method whose model ``method`` is evaluated with (itself, or its reader)."""
        return get_method(base_method(method)).reader or method

    def sft_for(self, method: str) -> dict:
        """The SFT job settings of ``method``: its table entry's, the profile's shared ones, then its own."""
        return {**get_method(method).train, **self.sft, **self.method_sft.get(method, {})}


#: the RL split's size in every profile of the default world (its questions depend on it): as many candidates as
#: the research profile's pool samples, and more
RL_QUESTIONS = 2000
#: the dev deep split's size in every profile of the default world: the one the research RL settings were chosen on
DEV_DEEP_QUESTIONS = 1500

#: the recipe that reaches the SFT figure (docs/BENCHMARKS.md, "One document per subquery, 1,200 SFT steps,
#: canonical subqueries")
RECIPE = Profile(
    world="default",
    # the induction-wired base with the gap and paraphrase warm-ups (prorag_app.embedded), three layers: SFT 1.29x
    # faster than four, and its agent no worse on dev (docs/BENCHMARKS.md, "Forty-fourth session")
    model_preset="cpu-induction-3l",
    vocab_size=8192,
    # restated questions and plan-carrying thoughts over the whole train split; 2,400 steps because at 1,200 the
    # agent was underfit (docs/BENCHMARKS.md, "Why the profiles' settings")
    sft={"max_questions": 0, "max_steps": 2400, "batch_size": 8, "lr": 3e-3, "log_every": 10,
         "checkpoint_every": 200, "restate_question": True, "plan_thoughts": True},
    method_sft={
        # one document per subquery, each relation asked one way: the small policy reads one far better than three
        "sft": {"topk": 1, "canonical_subqueries": True},
        # only when listed (its reading depended on the world): also each gold hop's answer read from its document
        "standard_rag_ft": {"hop_samples": True, "topk": 1}},
    stage2={
        # MCTS on 50 train questions: ProRAG's search cut to what 2 cores finish in minutes (the research profile:
        # 200); with the sampler on 200 the PRM passes its gate on dev as it did on twice both, in 7 minutes instead
        # of 12 (docs/BENCHMARKS.md, "Forty-fourth session")
        "mcts": {"max_questions": 50, "concurrency": 32, "max_step_tokens": 96, "seed": 1,
                 "mcts": {"simulations": 12, "expansions": 4, "max_children": 4}},
        # the sibling sampler on 200 train questions beside the trees: judged pairs that contain reading, subqueries
        # under another stated name, and sub-answers read from another relation of the same document
        "siblings": {"max_questions": 200, "samples": 4, "concurrency": 32, "max_step_tokens": 96, "max_steps": 10,
                     "seed": 1, "reading_samples": 2, "bridge_samples": 2, "relation_samples": 2},
        # a Bradley-Terry PRM on the pairs the reference judge labelled, scoring a step by its head plus twice its
        # trunk's mean log-probability of the step's written tokens, at a rate that keeps the trunk's reading
        # (chosen on dev: docs/BENCHMARKS.md, "Why the profiles' settings")
        "prm": {"epochs": 1, "batch_size": 8, "lr": 1e-4, "label_source": "judge", "likelihood_weight": 2.0},
        "eval_questions": 100},  # every corruption family on 100 dev questions, which the PRM gate reads
    stage34={
        # the headline: ProRAG without RFT against outcome GRPO (same start, questions, budget), ReasonRAG beside it
        "methods": ("outcome_grpo", "prorag_no_rft", "reasonrag"),
        # left out so `make run` keeps to its hour; results.json says where they run
        # (docs/BENCHMARKS.md, "Why the profiles' settings")
        "left_out": {m: "left out of the default profile to keep `make run` within its hour; the research and "
                        "ablation profiles run it (prorag run --profile research)" for m in ("rft", "prorag")},
        # as the reference does it, plus a gold SFT trajectory per kept one at a 5x lower rate: RFT alone stops early
        "rft": {"max_questions": 400, "samples_per_question": 4, "temperature": 0.8, "max_step_tokens": 96,
                "batch_size": 8, "lr": 1e-4, "replay": 1.0, "seed": 1, "prm_keep_fraction": 0.5},
        # the same questions, iterations, group size and rate for both RL methods, sized for 2 cores; the research
        # profile's dev choices (questions the agent sometimes fails, 4 steps at 1e-3 an iteration, the answer's F1),
        # so the rollouts' reward rises within 10 iterations (docs/BENCHMARKS.md, "Why the profiles' settings")
        # The questions are the world's RL split, 3+ hop questions SFT never saw: on dev RL there gained more over its
        # questions' start and lost nothing on unseen ones, where train questions, which SFT had fitted, lost
        # (docs/BENCHMARKS.md, "Why the profiles' settings")
        "rl": {"iterations": 10, "questions_per_iteration": 16, "group_size": 8, "lr": 1e-3, "mini_batches": 4,
               "split": RL_SPLIT, "reward": "f1", "min_hops": 3, "pool_max_solve_rate": 0.5, "max_step_tokens": 96,
               "checkpoint_every": 5, "seed": 1,
               # the arms differ in the process term only: no format term in the step score, and the answer
               # step, whose verdict repeats the outcome, left out of it (issue 47)
               "step_score": "verdict", "process_answer_step": False,
               # the PRM's logits centred per step kind within each group: on dev over two seeds the same as
               # uncentred within noise, kept (docs/BENCHMARKS.md, "Why the profiles' settings")
               "prm_centering": "per_kind"},
        # the learnable pool both RL methods draw from: the RL split's questions the SFT agent sometimes answers
        "pool": {"samples": 8, "max_questions": 240},
        # ReasonRAG's DPO with LoRA (its 1 epoch at 1e-6 is for full fine-tuning of a 7B model), lr chosen on dev as
        # the RL arms' settings were: 5e-4 lost to SFT (-2.5 [-3.8, -1.1], 1,675 questions of 3+ hops), 1e-4 did not
        # (+0.5 [-0.1, +1.1]; docs/BENCHMARKS.md, "Thirty-ninth session")
        "dpo": {"epochs": 3, "batch_size": 8, "lr": 1e-4, "seed": 1},
        "beta": 0.3},
    deep_questions=450,  # with the test split's 3+ hop questions, enough for the paired comparisons (issue 19)
    # the research profile's dev deep split: every profile of the world draws its later splits (held-out, RL) after
    # the same one, so running one profile never redraws what another trained or will read on
    dev_deep_questions=DEV_DEEP_QUESTIONS,
    rl_questions=RL_QUESTIONS)

#: the research profile's held-out split; a profile that reads none draws its RL split after one of this size, so
#: that a world shared by `make run` and the research run has one RL split, disjoint from that held-out split
HELDOUT_QUESTIONS = 2500

#: issue 30's experiment, sized for hours rather than `make run`'s hour (run over RESEARCH's three seeds)
RESEARCH_PROFILE = dataclasses.replace(
    RECIPE,
    # the four-layer base its run started on (shipped as prorag_app/bases/default-4l, beside `make run`'s), so the
    # research run's seeds share one model whatever `make run`'s became
    model_preset="cpu-induction", base_variant="4l",
    # 3,600 SFT steps: a better agent than 2,400 give, at a cost `make run`'s hour cannot pay
    # (docs/BENCHMARKS.md, "Why the profiles' settings")
    sft={**RECIPE.sft, "max_steps": 3600},
    stage2={**RECIPE.stage2,
            "mcts": {**RECIPE.stage2["mcts"], "max_questions": 200},
            # the default's sibling pairs from five times the questions (docs/BENCHMARKS.md, "Why the profiles'
            # settings")
            "siblings": {**RECIPE.stage2["siblings"], "max_questions": 2000},
            "eval_questions": 0},  # the PRM validated on the whole split
    stage34={**RECIPE.stage34,
             # the oracle ceiling (prorag_oracle) beside them: a diagnostic, never a headline
             "methods": ("rft", "prorag", "outcome_grpo", "prorag_no_rft", "prorag_oracle", "reasonrag"),
             "left_out": {},
             # RFT as the reference does it: per step, questions even over hop counts
             "rft": {**RECIPE.stage34["rft"], "filter": "step", "hop_balanced": True},
             # chosen on dev: questions the agent sometimes fails, as many iterations as still gained, no KL (it
             # weighed nothing), the answer's F1 as the reward (docs/BENCHMARKS.md, "Why the profiles' settings")
             "rl": {**RECIPE.stage34["rl"], "iterations": 45, "questions_per_iteration": 32, "kl_coef": 0.0,
                    # rollouts at temperature 0.7, the update reading the log-probs of that distribution: on dev at
                    # this budget outcome GRPO - SFT +4.2 [+2.4, +6.1] against +0.7 [-0.9, +2.5] at temperature 1
                    # (one seed, `make run`'s agent; docs/BENCHMARKS.md, "Fiftieth session"); on a world built with
                    # seed 1, where no choice was made, +5.7 [+3.8, +7.6] over two seeds ("Fifty-first session")
                    "temperature": 0.7, "tempered_logprobs": True},
             # a pool as large as the dev runs' that chose these settings
             "pool": {**RECIPE.stage34["pool"], "max_questions": 1500},
             "eval_iterations": (15,),  # a third of the RL questions: the data-efficiency point
             # every arm runs whatever the gate says; its verdict and figures stand beside the results (issue 47)
             "prm_gate": "report"},
    # enough held-out 3+ hop questions to halve one seed's interval; never used for a choice
    # (docs/BENCHMARKS.md, "Why the profiles' settings")
    heldout_questions=HELDOUT_QUESTIONS)

PROFILES = {
    # what the end-to-end test runs: every stage, in minutes
    "tiny": Profile(world="tiny", model_preset="tiny", vocab_size=2048,
                    sft={"max_steps": 24, "batch_size": 8, "lr": 3e-3, "log_every": 4, "checkpoint_every": 12},
                    stage2={"mcts": {"max_questions": 6, "concurrency": 3, "max_step_tokens": 64, "seed": 1,
                                     "mcts": {"simulations": 4, "expansions": 2, "max_children": 2, "max_depth": 6}},
                            "prm": {"epochs": 1, "batch_size": 4, "log_every": 1, "checkpoint_every": 10,
                                    "label_source": "judge", "likelihood_weight": 2.0},
                            "eval_questions": 20},
                    stage34={"rft": {"max_questions": 8, "samples_per_question": 2, "max_step_tokens": 32,
                                     "max_train_steps": 2, "batch_size": 2, "checkpoint_every": 1},
                             "rl": {"iterations": 2, "questions_per_iteration": 4, "group_size": 2,
                                    "max_step_tokens": 32, "max_steps": 4, "lr": 1e-3, "lora_r": 4, "lora_alpha": 8,
                                    "checkpoint_every": 1, "split": RL_SPLIT},
                             "dpo": {"epochs": 1, "batch_size": 4, "lora_r": 4, "lora_alpha": 8}},
                    deep_questions=8, heldout_questions=6, rl_questions=8),
    "default": RECIPE,
    # stage 1 of the recipe alone (~25 minutes on 2 cores): the SFT figure on worlds built with other seeds
    "stage1": dataclasses.replace(RECIPE, methods=("standard_rag", "sft"), stage2=None, stage34=None),
    "full": RECIPE,  # the recipe's other name, which outside scripts call
    # a quick check of the whole pipeline (~12 minutes): the plain `cpu` base, 240 SFT steps; its agent stays below
    # the figure (docs/BENCHMARKS.md)
    "quick": Profile(world="default", model_preset="cpu", vocab_size=8192, base_warmup={}, base_variant="quick",
                     sft={"max_questions": 3000, "max_steps": 240, "batch_size": 8, "lr": 3e-3, "log_every": 10,
                          "checkpoint_every": 60}),
    "research": RESEARCH_PROFILE,
}


@dataclass(frozen=True)
class AblationPlan:
    """What a multi-run plan runs on top of a profile: `prorag run --profile ablation` (issue 19's report: the headline
    comparison over several stage 3-4 seeds, the first with ProRAG without RFT and the RL adapters of earlier
    iterations evaluated too, and ProRAG at other betas) or `--profile research` (issue 30's experiment over three
    seeds); then `prorag report` over all of them."""

    profile: str = "default"
    name: str = "ablation"  # the runs' names: <name>/seed<k>, <name>/beta<b>
    seeds: tuple[int, ...] = (1, 2, 3)  # stage 3-4 seeds; 1 is the profile's own, so `make run`'s jobs are reused
    betas: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9)  # besides the profile's 0.3, at the first seed
    eval_iterations: tuple[int, ...] = (3, 5)  # RL adapters evaluated after these iterations (3 of 10: a third)
    #: the stage 3-4 methods of every seed's run (empty: the profile's own): the ablation compares the full ProRAG
    #: (RFT first), which the default profile leaves out for time
    methods: tuple[str, ...] = ("rft", "prorag", "outcome_grpo", "prorag_no_rft", "reasonrag")


#: issue 19's report: the headline comparison over three seeds, and ProRAG at other betas
ABLATION = AblationPlan()
#: issue 30's table: the research profile over three seeds (its own eval_iterations), no beta sweep
RESEARCH = AblationPlan(profile="research", name="research", betas=(), eval_iterations=(), methods=())
PLANS = {"ablation": ABLATION, "research": RESEARCH}


# ---------------------------------------------------------------- a profile changed for one run
def with_stage34(prof: Profile, seed: int | None = None, beta: float | None = None) -> Profile:
    """``prof`` with its stage 3-4 jobs' seed (RFT, RL, DPO) and ProRAG's beta replaced where given: the knobs
    of the headline comparison's seeds and of the beta sweep (``prorag report`` pools such runs)."""
    if prof.stage34 is None or (seed is None and beta is None):
        return prof
    s34 = {k: (dict(v) if isinstance(v, dict) else v) for k, v in prof.stage34.items()}
    if seed is not None:
        for job in ("rft", "rl", "dpo"):
            s34[job] = {**s34.get(job, {}), "seed": int(seed)}
    if beta is not None:
        s34["beta"] = float(beta)
    return dataclasses.replace(prof, stage34=s34)


def with_overrides(prof: Profile, assignments: list[str] | tuple[str, ...]) -> Profile:
    """``prof`` with ``KEY=VALUE`` assignments applied (`prorag run --set`): KEY is a dotted path into the profile
    (``stage34.rft.lr``, ``stage34.methods``), VALUE is JSON (a bare word is taken as a string). The result is
    checked like any profile, so an unknown field or a bad value fails before anything runs."""
    fields_ = {f.name for f in dataclasses.fields(Profile)}
    changes: dict = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        path = [k for k in key.strip().split(".") if k]
        if not sep or not path:
            raise InvalidArgument(f"--set {assignment!r}: write KEY=VALUE, e.g. stage34.rft.lr=1e-4")
        if path[0] not in fields_:
            raise InvalidArgument(f"--set {key}: the profile has no field {path[0]!r} (it has {sorted(fields_)})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, list):
            value = tuple(value)
        if len(path) == 1:
            changes[path[0]] = value
            continue
        root = changes.get(path[0], getattr(prof, path[0]))
        if not isinstance(root, dict):
            raise InvalidArgument(f"--set {key}: profile field {path[0]!r} is not a settings dict")
        root = node = json.loads(json.dumps(root))  # a deep copy: the profile's own dicts stay as they are
        for k in path[1:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise InvalidArgument(f"--set {key}: {k!r} is not a settings dict")
        node[path[-1]] = value
        changes[path[0]] = root
    return dataclasses.replace(prof, **changes) if changes else prof
