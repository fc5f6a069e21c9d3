"""The Trainer gRPC servicer: converts messages and calls the JobManager (the checks of a job are its, and its
stages'); a watch stream follows the job through services.trainer.watch; errors map via the interceptor."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prorag.pb import trainer_pb2, trainer_pb2_grpc
from services.trainer.jobs import Artifact, Job, JobManager, JobState
from services.trainer.watch import JobWatcher

STATE_TO_PB = {state: trainer_pb2.JobState.Value(f"JOB_STATE_{state.value}") for state in JobState}


def _artifacts(run_dir: str, arts: list[Artifact]) -> list[trainer_pb2.Artifact]:
    # Records keep paths relative to the run dir; callers get absolute ones.
    return [trainer_pb2.Artifact(name=a.name, path=str(Path(run_dir) / a.path), sha256=a.sha256) for a in arts]


def job_to_pb(job: Job) -> trainer_pb2.Job:
    return trainer_pb2.Job(
        job_id=job.job_id, stage=job.stage, state=STATE_TO_PB[job.state], config_json=job.config_json,
        run_dir=job.run_dir, step=job.step, total_steps=job.total_steps, error=job.error,
        artifacts=_artifacts(job.run_dir, job.artifacts), created_at=job.created_at,
        updated_at=job.updated_at, metrics=job.metrics, outputs=job.outputs)


def event_to_pb(ev: dict, run_dir: str) -> trainer_pb2.JobEvent:
    return trainer_pb2.JobEvent(
        job_id=ev["job_id"], seq=ev["seq"], state=STATE_TO_PB[JobState(ev["state"])], step=ev.get("step", 0),
        total_steps=ev.get("total_steps", 0), loss=ev.get("loss") or 0.0, tokens_per_s=ev.get("tokens_per_s") or 0.0,
        eta_s=ev.get("eta_s") or 0.0, message=ev.get("message", ""),
        artifacts=_artifacts(run_dir, [Artifact.from_dict(a) for a in ev.get("artifacts") or []]),
        metrics=ev.get("metrics") or {})


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, manager: JobManager):
        self.manager = manager
        self.watcher = JobWatcher(manager)

    def close(self) -> None:
        """End open watch streams with UNAVAILABLE so clients re-watch after a restart."""
        self.watcher.close()

    async def StartJob(self, request, context):
        # Submission touches the disk (fsync); keep the event loop free for watchers.
        job = await asyncio.to_thread(self.manager.submit, request.stage, request.config_json, request.job_id)
        return job_to_pb(job)

    async def CancelJob(self, request, context):
        return job_to_pb(await asyncio.to_thread(self.manager.cancel, request.job_id))

    async def GetJob(self, request, context):
        return job_to_pb(self.manager.get(request.job_id))

    async def ListJobs(self, request, context):
        return trainer_pb2.ListJobsResponse(jobs=[job_to_pb(j) for j in self.manager.list(request.stage)])

    async def WatchJob(self, request, context):
        async for event, run_dir in self.watcher.events(request.job_id, request.after_seq):
            yield event_to_pb(event, run_dir)
