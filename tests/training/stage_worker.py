"""Run by tests/training/test_distributed.py, alone or under torchrun with 2 gloo processes: the trainer stages of a
plan, one after another in one process group, each through the launcher's run_stage (services/trainer/launch.py)
as `python -m services.trainer.launch` runs one; starting the processes once for all of them keeps the test
short. The plan (argv[1], JSON) is a list of {"stage", "config", "work_dir", "stop_at" (optional: the main
process stops the stage once it reports that step, as a stopping trainer does), "expect_error" (optional: the
stage is meant to fail; each process writes what it raised to work_dir/error-<rank>.txt and the plan goes on)};
the main process writes each stage's progress events to work_dir/events.json."""

import json
import sys
import threading
from pathlib import Path


def main(plan_path: str) -> None:
    import torch

    from prorag.training.distributed import accelerator_from_env, finish_distributed
    from services.trainer.launch import run_stage

    torch.set_num_threads(1)
    accelerator = accelerator_from_env(cpu=True)
    for entry in json.loads(Path(plan_path).read_text()):
        events: list[dict] = []
        stop = threading.Event()

        def emit(event, stop_at=entry.get("stop_at")):
            events.append(event)
            if stop_at is not None and event.get("loss") is not None and event["step"] >= stop_at:
                stop.set()

        try:
            run_stage(entry["stage"], entry["config"], entry["work_dir"], accelerator, emit=emit, stop=stop)
        except Exception as exc:
            if not entry.get("expect_error"):
                raise
            rank = accelerator.process_index if accelerator is not None else 0
            (Path(entry["work_dir"]) / f"error-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        if accelerator is None or accelerator.is_main_process:
            (Path(entry["work_dir"]) / "events.json").write_text(json.dumps(events, default=str))
    finish_distributed(accelerator)


if __name__ == "__main__":
    main(sys.argv[1])
