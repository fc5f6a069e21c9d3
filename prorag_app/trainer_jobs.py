"""Running a training job through the trainer service, and naming jobs by their settings.

Shared by every stage runner (prorag_app.pipeline's SFT jobs, prorag_app.stage2, prorag_app.stage34), so none of
them imports another for it.
"""

from __future__ import annotations

import hashlib
import json
import time

from rich.console import Console

from prorag.progress import progress_bars
from prorag.rpc.clients_trainer import TrainerClient, state_name

console = Console()

#: settings that say where a job's services are, or how fast it runs, not what it trains
ADDRESS_KEYS = ("policy", "prm", "retriever", "judge", "threads")


def run_job(stack, stage: str, config: dict, job_id: str, before_start=None) -> dict:
    """Run (or reuse) one trainer job and wait; returns the finished Job as a dict of metrics and outputs.
    before_start(): called only when the job is submitted, not when a finished one is reused (it starts the
    services the job samples through: prorag_app.stack.OnDemand.need)."""
    with TrainerClient(stack.grpc_target("trainer"), timeout=60, wait_for_ready=True) as client:
        existing = {j.job_id: j for j in client.list(stage)}
        if job_id in existing and state_name(existing[job_id].state) == "SUCCEEDED":
            console.print(f"[green]{stage}[/green]: reusing finished job {job_id}")
        else:
            if before_start is not None:
                before_start()
            client.start(stage, config, job_id=job_id)
            with progress_bars() as progress:
                follow_job(client, job_id, stage, progress, gone=trainer_gone(stack))
        job = client.get(job_id)
        if state_name(job.state) != "SUCCEEDED":
            raise SystemExit(f"{stage} job {job_id} ended {state_name(job.state)}: {job.error}")
        return {"job_id": job_id, "metrics": dict(job.metrics), "outputs": dict(job.outputs), "run_dir": job.run_dir}


def trainer_gone(stack):
    """gone() for TrainerClient.watch: why ``stack``'s own trainer process is no longer running, else None; None in
    place of gone() for a stack that only reaches services run elsewhere (nothing to ask: the watch waits)."""
    exit_message = getattr(stack, "exit_message", None)
    return None if exit_message is None else (lambda: exit_message("trainer"))


def follow_job(client, job_id: str, label: str, progress, gone=None) -> float:
    """Show ``job_id``'s events (progress bar ``label``, messages) until the trainer ends the watch, which it
    does once the job is terminal; returns the seconds the job ran since it was last queued (0.0 if it never ran).

    The watch replays the job's past events first, and a job submitted again after it FAILED or was CANCELLED
    has that end among them: so the end is the stream's end, never a terminal event seen on the way (stopping
    there left a resumed job running unwatched). gone: TrainerClient.watch's (trainer_gone)."""
    began = None
    for ev in client.watch(job_id, gone=gone):
        state = state_name(ev.state)
        if state == "QUEUED":
            began = None  # (re-)queued: its running time starts when it next runs
        elif state == "RUNNING" and began is None:
            began = time.monotonic()
        if ev.total_steps:
            progress(label, int(ev.step), int(ev.total_steps))
        if ev.message and not ev.message.startswith("checkpoint"):
            console.print(f"[dim]{label}: {ev.message[:200]}[/dim]")
    return time.monotonic() - began if began is not None else 0.0


def settings_job_id(prefix: str, stage: str, cfg: dict, extra: dict | None = None) -> str:
    """Same settings (and ``extra``: inputs or behaviour versions the settings do not show) -> same id, so a second
    run reuses the finished job; the ADDRESS_KEYS are left out (they move with --port-offset)."""
    key = {**{k: v for k, v in cfg.items() if k not in ADDRESS_KEYS}, **(extra or {})}
    return f"{prefix}-{stage}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]}"


__all__ = ["ADDRESS_KEYS", "follow_job", "run_job", "settings_job_id", "trainer_gone"]
