"""The fields every gradient-descent stage shares, in one base config each stage's config inherits (TRL's shape).

A stage config subclasses :class:`TrainRunConfig` and redeclares a field only to change its default or help
(e.g. RL's constant learning rate of 1e-5). Where the model runs and in what precision comes from
:class:`prorag.training.devices.ComputeConfig`; how the optimiser runs from here, turned into the one loop's
:class:`prorag.training.loop.LoopConfig` by :meth:`TrainRunConfig.loop_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorag.config import cfg_field
from prorag.training.devices import ComputeConfig, Placement, resolve
from prorag.training.loop import LoopConfig

TRACKERS = ("", "wandb", "local")


@dataclass
class StageRunConfig(ComputeConfig):
    """Device, precision, seed, checkpoint and log intervals, threads and tracking: every training stage's."""

    seed: int = cfg_field(0, help="seed for data order, initialisation and sampling", min=0, max=2 ** 31 - 1)
    checkpoint_every: int = cfg_field(100, help="optimizer steps between checkpoints", min=1)
    log_every: int = cfg_field(10, help="optimizer steps between progress events", min=1)
    threads: int = cfg_field(0, help="torch CPU threads (0 = leave as is)", min=0, max=256)
    tracking: str = cfg_field("", help="'wandb' or 'local'; '' = the trainer's default", choices=TRACKERS)

    def placement(self) -> Placement:
        """The resolved device, compute dtype and attention kernel (checked already when the config was built)."""
        return resolve(self)

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


@dataclass
class TrainRunConfig(StageRunConfig):
    """StageRunConfig plus the optimiser's settings: the SFT, PRM, RFT, RL and DPO stages' base (the warm-up's
    curriculum carries its own learning rate and ramp)."""

    lr: float = cfg_field(1e-4, help="peak learning rate (the schedule scales it)", min=0.0, max=1.0)
    warmup_ratio: float = cfg_field(0.05, help="fraction of the steps with a linear learning-rate warm-up",
                                    min=0.0, max=0.5)
    weight_decay: float = cfg_field(0.0, help="AdamW (decoupled) weight decay", min=0.0, max=1.0)
    grad_clip: float = cfg_field(1.0, help="max gradient norm (0 = off)", min=0.0)

    def loop_config(self, steps: int, *, schedule: str = "warmup_cosine", grad_accum: int = 1,
                    beta2: float = 0.95, checkpoint_every: int | None = None, log_every: int | None = None):
        """The one loop's settings for ``steps`` optimizer steps from this config's fields."""
        return LoopConfig(steps=steps, optimizer="adamw", lr=self.lr, beta1=0.9, beta2=beta2,
                          weight_decay=self.weight_decay, schedule=schedule,
                          warmup_steps=int(steps * self.warmup_ratio), grad_clip=self.grad_clip, grad_accum=grad_accum,
                          checkpoint_every=checkpoint_every or self.checkpoint_every,
                          log_every=log_every or self.log_every, compile=self.compile)


__all__ = ["StageRunConfig", "TRACKERS", "TrainRunConfig"]
