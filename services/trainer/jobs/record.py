"""A job's record (``job.json``) and its events (lines of ``events.jsonl``).

The names on disk and on the wire are the record's field names and :class:`JobState`'s values, so a
``job.json`` keeps loading across versions: a field it lacks (one added since it was written) takes its
default, and a key this version does not know is ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import enum
from dataclasses import dataclass, field
from typing import Any


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobState(enum.Enum):
    """A job's state; each value is the name job.json, events.jsonl and the Trainer API's JobState use."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """The job changes no more, unless the same submission brings a FAILED or CANCELLED one back."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass
class Artifact:
    """An output a stage registered; its digest is re-taken for the manifest when the job succeeds."""

    name: str
    path: str  # relative to the job's run dir
    sha256: str

    @classmethod
    def from_dict(cls, d: dict) -> Artifact:
        return cls(name=d["name"], path=d["path"], sha256=d["sha256"])


@dataclass
class Job:
    """One job's record, as job.json holds it."""

    job_id: str
    stage: str
    state: JobState
    config: dict[str, Any]  # validated, defaults filled in
    config_json: str  # canonical JSON of ``config``: a resubmission is recognised by it
    inputs: dict[str, dict]  # input name -> {"path", "sha256"} of the manifest of the run it reads
    run_dir: str
    checkpoint_dir: str
    created_at: str
    updated_at: str
    step: int = 0
    total_steps: int = 0
    error: str = ""
    traceback: str = ""
    artifacts: list[Artifact] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the latest value of each numeric metric
    outputs: dict[str, str] = field(default_factory=dict)  # what the stage published, e.g. registry references
    started_at: str = ""  # by the first attempt
    finished_at: str = ""
    attempts: int = 0
    last_seq: int = 0  # of its newest event
    cancel_requested: bool = False
    resumed_from_step: int | None = None
    stopped_cleanly: bool = False  # the trainer stopped it: re-queued at the next start without counting a death
    process_deaths: int = 0  # times its process died under it while RUNNING

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Job:
        """The record a job.json holds; ValueError saying what is missing or malformed."""
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ValueError(f"job record {d.get('job_id', '')!r} lacks {', '.join(missing)}")
        known = {f.name for f in fields}
        try:
            return cls(**{**{k: v for k, v in d.items() if k in known}, "state": JobState(d["state"]),
                          "artifacts": [Artifact.from_dict(a) for a in d.get("artifacts", [])]})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"job record {d.get('job_id', '')!r}: malformed ({type(exc).__name__}: {exc})") from None

    def copy(self) -> Job:
        """A snapshot that later changes of the record do not reach."""
        return copy.deepcopy(self)

    def add_metrics(self, values: dict) -> None:
        """Keep the latest value of each numeric metric in ``values``."""
        self.metrics.update(numeric(values))

    def event(self, seq: int, **fields: Any) -> dict:
        """Event ``seq`` of this job as events.jsonl holds it: its state and progress now, then ``fields`` (None ones
        left out)."""
        ev = {"job_id": self.job_id, "seq": seq, "state": self.state.value, "time": now_iso(), "step": self.step,
              "total_steps": self.total_steps, "message": ""}
        ev.update({k: v for k, v in fields.items() if v is not None})
        return ev


def numeric(values: dict) -> dict[str, float]:
    """The numbers among ``values`` as floats (a bool is not one)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
