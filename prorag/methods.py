"""The one method table: every method the project trains or compares, how it is trained and how it is evaluated.

The CLI's choices, the pipeline, the evaluation runners and the trainer's SFT modes all read this table,
so a method is added in one place. A method's ``kind`` says how it answers:

- ``agent``: ProRAG's step format, server-side rollouts that search as they go (SFT, and later RFT and RL);
- ``no_retrieval``: question -> answer;
- ``standard_rag``: the question's top-k documents, then the answer (a model fine-tuned for it);
- ``single_search``: an agent's model held to one search, made with the question itself: standard RAG read by
  the agent's own reader (``Method.reader``), so it reads exactly as well as the agent and differs only in
  how it searches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prorag.errors import InvalidArgument

#: the SFT stage's ``mode`` (the data it trains on); a method of one of these kinds is trained in that mode
SFT_MODES = ("agent", "no_retrieval", "standard_rag")
#: how a method answers
KINDS = (*SFT_MODES, "single_search")


@dataclass(frozen=True)
class Method:
    name: str
    kind: str
    stage: str = "sft"  # the trainer stage that produces its model ("" = none: it reads with ``reader``'s model)
    description: str = ""
    #: settings of its training job on top of a run profile's shared ones (e.g. its SFT mode)
    train: dict = field(default_factory=dict)
    #: settings of its evaluation (the agent's step limit; documents per search come from the model's manifest)
    evaluate: dict = field(default_factory=dict)
    #: the method whose trained model this one evaluates with, training nothing of its own
    reader: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"method {self.name}: kind must be one of {list(KINDS)}, got {self.kind!r}")
        if bool(self.reader) != (self.stage == ""):
            raise InvalidArgument(f"method {self.name}: a method trains (a stage) or reads with another's model "
                                  f"(a reader), exactly one of them")


#: ProRAG inference's step limit (ANCHORS: 13 steps at inference and in RFT)
AGENT_MAX_STEPS = 13
#: documents per search, ProRAG's top-3; a published model's manifest says what it was trained with
DOCS_PER_SEARCH = 3

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("no_retrieval", "no_retrieval", description="fine-tuned to answer from the question alone",
           train={"mode": "no_retrieval"}),
    # The fair standard-RAG baseline (issue 16): one search with the question, its top-k documents read by the SFT
    # agent's own model, which then answers. A separately fine-tuned reader (standard_rag_ft) read far worse than
    # the agent on 1-hop questions on most worlds (docs/BENCHMARKS.md), which measured training luck, not
    # searching; with the same reader the comparison isolates what step-by-step search adds.
    Method("standard_rag", "single_search", stage="", reader="sft",
           description="standard RAG with the agent's reader: one search with the question, its top-k documents, "
                       "read and answered by the SFT model in its own step format"),
    Method("standard_rag_ft", "standard_rag", description="fine-tuned to answer from the question's top-k documents",
           train={"mode": "standard_rag"}),
    Method("sft", "agent", description="ProRAG stage 1: SFT on gold step-by-step trajectories",
           train={"mode": "agent"}, evaluate={"max_steps": AGENT_MAX_STEPS}),
    # stages 3-4 and the baselines trained from the same SFT model (prorag_app.stage34)
    Method("rft", "agent", stage="rft", description="ProRAG stage 3: the SFT model fine-tuned on its own sampled "
                                                    "trajectories that are correct and PRM-approved at every step",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
    Method("prorag", "agent", stage="rl", description="ProRAG: process-supervised GRPO (LoRA) on the RFT model, "
                                                      "outcome + beta x PRM step advantage",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
    Method("outcome_grpo", "agent", stage="rl", description="Search-R1-style outcome-only GRPO (LoRA) on the SFT "
                                                            "model: the same RL code, beta 0, no RFT",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
    Method("prorag_no_rft", "agent", stage="rl", description="ablation: ProRAG's RL (PRM step advantage) from the SFT "
                                                             "model, without RFT",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
    # issue 30's oracle ceiling: it reads the gold decomposition, so it bounds what any PRM could add at this
    # budget and is never reported as a result of its own
    Method("prorag_oracle", "agent", stage="rl", description="diagnostic, never a headline: ProRAG's RL from the SFT "
                                                             "model with each step scored by the reference judge "
                                                             "on the gold decomposition (right entity, supported "
                                                             "sub-answer, no repeated search) instead of the PRM: "
                                                             "the ceiling of the process term",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
    Method("reasonrag", "agent", stage="dpo", description="ReasonRAG: DPO (LoRA) on the SFT model with sibling-step "
                                                          "pairs from the same MCTS trees, ordered by shortest-path "
                                                          "reward estimation",
           evaluate={"max_steps": AGENT_MAX_STEPS}),
)}

#: methods trained by the SFT stage (the pipeline's `Profile.methods`)
SFT_METHODS = tuple(m.name for m in METHODS.values() if m.stage == "sft")

#: the paired comparisons (A, B) that results.json and `prorag report` give, A minus B per question on 3+ hop
#: questions, where both were evaluated; issue 19 names the first three
COMPARISONS = (("prorag", "outcome_grpo"), ("outcome_grpo", "sft"), ("prorag", "sft"), ("rft", "sft"),
               ("prorag", "rft"), ("prorag", "reasonrag"), ("reasonrag", "sft"), ("prorag", "prorag_no_rft"),
               # issue 30: the oracle ceiling and the same-start headline
               ("prorag_oracle", "outcome_grpo"), ("prorag_no_rft", "outcome_grpo"))


def get_method(name: str) -> Method:
    """The table's entry for ``name``; InvalidArgument naming the known methods otherwise."""
    if name not in METHODS:
        raise InvalidArgument(f"unknown method {name!r} (known: {', '.join(METHODS)})")
    return METHODS[name]


def base_method(name: str) -> str:
    """The table's method behind an evaluated name: ``prorag@it5`` (an RL method's adapter after 5 iterations)
    -> ``prorag``; other names as they are."""
    return name.split("@", 1)[0]


def kind_of(name: str) -> str:
    """How ``name`` answers; a model outside the table (a user's own name) is evaluated as an agent."""
    name = base_method(name)
    return METHODS[name].kind if name in METHODS else "agent"


__all__ = ["SFT_MODES", "KINDS", "Method", "METHODS", "SFT_METHODS", "AGENT_MAX_STEPS", "COMPARISONS",
           "DOCS_PER_SEARCH", "base_method", "get_method", "kind_of"]
