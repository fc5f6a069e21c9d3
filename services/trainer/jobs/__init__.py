"""Persistent training jobs.

Layout under the jobs root (default ``<PRORAG_HOME>/runs/jobs``)::

    .trainer.lock            flock'ed by the one trainer using this root (its pid inside)
    <job_id>/job.json        the job record, replaced atomically on every change
    <job_id>/events.jsonl    one JSON event per line, fsynced per event; seq survives restarts
    <job_id>/job.log         log records of the job's worker thread, appended per attempt
    <job_id>/checkpoints/    step-<N>.pt, last K kept
    <job_id>/run/            outputs: artifacts, metrics.jsonl, wandb/, and manifest.json (written last)

Jobs run in worker threads of the trainer process (one at a time by default; ``parallel_jobs``
workers side by side), so killing the trainer kills its jobs too. On start the manager re-queues jobs a killed
trainer left QUEUED or RUNNING; their stages resume from the last checkpoint. A job whose process died under it
``max_attempts`` times (a crash it causes, e.g. out of memory, would otherwise loop forever) is FAILED
instead. One trainer at a time owns a jobs root (an exclusive flock held for the manager's life): two
would run the same queued jobs side by side and corrupt their records.

Modules: ``record`` (a job's record and events, typed), ``store`` (their files), ``ledger`` (records and
events in memory, persisted on every change, and their watchers), ``admission`` (what a submission must pass),
``runner`` (one job's run in a worker thread), ``manager`` (queue, workers, restarts and the servicer's API).
"""

from services.trainer.jobs.manager import JobManager
from services.trainer.jobs.record import Artifact, Job, JobState
from services.trainer.jobs.store import JobStore

__all__ = ["Artifact", "Job", "JobManager", "JobState", "JobStore"]
