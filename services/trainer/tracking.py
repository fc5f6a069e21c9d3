"""Experiment tracking for a job: a local ``metrics.jsonl`` always, Weights & Biases when it works.

W&B runs offline unless ``WANDB_API_KEY`` is set (an explicit ``WANDB_MODE`` wins), with
the job's run dir as its directory, so nothing leaves the machine by default. If
``wandb.init`` fails (not installed, no network, a broken service process) the job
goes on with the local file only: tracking must never fail a training run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from prorag.io import atomic_path

log = logging.getLogger("prorag.trainer.tracking")

MODES = ("wandb", "local")


def wandb_mode() -> str:
    explicit = os.environ.get("WANDB_MODE")
    if explicit:
        return explicit
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class Tracker:
    """Logs ``(step, metrics)`` rows to ``<run_dir>/metrics.jsonl`` and, in "wandb" mode, to W&B."""

    def __init__(self, run_dir: str | Path, job_id: str, stage: str, config: dict, mode: str = "wandb"):
        if mode not in MODES:
            raise ValueError(f"tracking must be one of {list(MODES)}, got {mode!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.mode = mode
        self._wandb_run = None
        self._fh = None
        if mode == "wandb":
            self._wandb_run = self._init_wandb(job_id, stage, config)

    def _init_wandb(self, job_id: str, stage: str, config: dict):
        mode = wandb_mode()
        if mode == "disabled":
            return None
        try:
            import wandb

            run_id = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:64]
            return wandb.init(project=os.environ.get("WANDB_PROJECT", "prorag"), name=job_id, id=run_id,
                              group=stage, job_type=stage, config=config, dir=str(self.run_dir), mode=mode,
                              resume="allow", reinit="finish_previous",
                              settings=wandb.Settings(silent=True, console="off"))
        except Exception as exc:  # noqa: BLE001 - tracking is optional, training is not
            log.warning("wandb.init failed (%s: %s); job %s continues with %s only",
                        type(exc).__name__, exc, job_id, self.path)
            return None

    @property
    def wandb_active(self) -> bool:
        return self._wandb_run is not None

    def rewind(self, step: int) -> None:
        """Forget rows after ``step`` (a resumed job logs them again) and any torn last line."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line)
        self.close_file()
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = _clean(metrics)
        if not clean:
            return
        if self._fh is None:
            self._fh = open(self.path, "a")
        # One write per row: a kill leaves at most a torn last line, which rewind() drops.
        self._fh.write(json.dumps({"step": int(step), **clean}, sort_keys=True) + "\n")
        self._fh.flush()
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({**clean, "trainer/step": int(step)})
            except Exception as exc:  # noqa: BLE001
                log.warning("wandb log failed (%s); continuing with %s only", exc, self.path)
                self._wandb_run = None

    def summary(self, metrics: dict[str, Any]) -> None:
        if self._wandb_run is not None:
            try:
                self._wandb_run.summary.update(_clean(metrics))
            except Exception as exc:  # noqa: BLE001
                log.warning("wandb summary failed: %s", exc)

    def close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def finish(self, exit_code: int = 0) -> None:
        self.close_file()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish(exit_code=exit_code)
            except Exception as exc:  # noqa: BLE001
                log.warning("wandb finish failed: %s", exc)
            self._wandb_run = None
