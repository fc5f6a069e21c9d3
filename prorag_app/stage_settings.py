"""What a profile asks of stages 2-4, as typed settings: data the stage runners read (prorag_app.stage2 and
prorag_app.stage34) and the profiles are checked against (prorag_app.profiles), kept apart from both so neither
imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorag.config import ConfigError, cfg_field, check_fields
from services.trainer.stage_siblings import SiblingsStageConfig


@dataclass
class Stage2Settings:
    """What a profile asks of stage 2 (the trainer's mcts and prm jobs take the rest from their defaults)."""

    mcts: dict = cfg_field(help="mcts job settings (services.trainer.stage_mcts.MCTSStageConfig)", factory=dict)
    siblings: dict = cfg_field(help="siblings job settings (services.trainer.stage_siblings.SiblingsStageConfig): "
                                    "judged pairs sampled along the agent's trajectories; empty = no siblings job",
                               factory=dict)
    prm_pairs: str = cfg_field("all", help="the pairs the PRM trains on: all (the MCTS pairs, and the siblings "
                                           "job's when it runs), mcts, or siblings (the MCTS job still runs: its "
                                           "value-labelled pairs are ReasonRAG's DPO data)",
                               choices=("all", "mcts", "siblings"))
    prm: dict = cfg_field(help="prm job settings (services.trainer.stage_prm.PRMConfig)", factory=dict)
    eval_questions: int = cfg_field(0, help="dev questions whose gold steps validate and gate the PRM (0 = all)", min=0)
    seed: int = cfg_field(0, help="seed of the corruptions", min=0)

    def validate(self) -> None:
        check_fields(SiblingsStageConfig, self.siblings, prefix="siblings.")
        if self.prm_pairs == "siblings" and not self.siblings:
            raise ConfigError("prm_pairs", "'siblings' needs a siblings job: set siblings (e.g. "
                                           "{\"max_questions\": 2000})")


@dataclass
class Stage34Settings:
    """What a profile asks of stages 3-4 (the trainer's rft and rl jobs take the rest from their defaults)."""

    methods: tuple = cfg_field(("rft", "prorag", "outcome_grpo", "reasonrag"),
                               help="which of rft, prorag, outcome_grpo, reasonrag, prorag_no_rft and prorag_oracle "
                                    "to train and evaluate")
    eval_iterations: tuple = cfg_field((), help="RL iterations whose adapters are also evaluated, as "
                                                "<method>@it<i> (F1 against RL questions: data efficiency)")
    rft: dict = cfg_field(help="rft job settings (services.trainer.stage_rft.RFTConfig)", factory=dict)
    rl: dict = cfg_field(help="rl job settings shared by every RL method (prorag, outcome_grpo, prorag_no_rft, "
                              "prorag_oracle; services.trainer.stage_rl.RLConfig): the same questions, iterations, "
                              "group size and learning rate for all",
                         factory=dict)
    dpo: dict = cfg_field(help="reasonrag's dpo job settings (services.trainer.stage_dpo.DPOConfig)", factory=dict)
    pool: dict = cfg_field(help="settings of an rlpool job (services.trainer.stage_rlpool.RLPoolConfig, e.g. "
                                "{\"samples\": 8}) run once from the SFT model before any RL job; every RL method then "
                                "draws its questions from its learnable ones (empty = off: the whole split)",
                           factory=dict)
    beta: float = cfg_field(0.3, help="ProRAG's weight of the process advantage (outcome_grpo: 0)", min=0.0,
                            max=10.0)
    left_out: dict = cfg_field(help="stage 3-4 methods this profile leaves out on purpose, {method: why}: reported "
                                    "under results.json's stage34.skipped with the reason, so a reader sees that the "
                                    "method was not run and where it is (one in methods runs all the same)",
                               factory=dict)
    prm_gate: str = cfg_field("report", help="what stage 2's PRM gate (prorag.prm.evaluation.prm_gate) decides: "
                                             "enforce = a PRM below it guides nothing (rft, prorag, prorag_no_rft "
                                             "skipped with the reasons; outcome_grpo, prorag_oracle and reasonrag "
                                             "still run); report = the PRM-guided methods run and results.json "
                                             "carries the verdict beside them", choices=("report", "enforce"))


__all__ = ["Stage2Settings", "Stage34Settings"]
