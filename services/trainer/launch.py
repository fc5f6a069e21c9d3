"""One trainer stage outside the trainer service, on one process or on every process of a multi-GPU / multi-node
launch: ``python -m services.trainer.launch STAGE CONFIG.json WORK_DIR``.

Under ``accelerate launch`` (GPU hosts, with its config file choosing DDP or FSDP2) or torchrun (RANK / WORLD_SIZE
/ MASTER_ADDR set), every process runs the stage with an ``accelerate.Accelerator`` on its context: the one
training loop splits each optimizer step's micro-batches over the processes (prorag.training.distributed). Only
the main process talks to the services (the retriever's documents for SFT, the policy's and PRM's samples for
RFT, RL's rollouts and adapter pushes) and hands the data to the others, and only it writes progress and what
the stage publishes, gathered from every process's shard first. Checkpoints hold every process's part
(accelerate's save_state, renamed into place once all are written). The job config is checked as the trainer
service checks it (names, paths under the data roots, endpoints on the allowlist). A killed launch started again
with the same WORK_DIR and config resumes from its last checkpoint; WORK_DIR must be on storage every node of
the launch sees (each process writes its part of a checkpoint there).

Why not inside the trainer service: a multi-node job is started by the cluster (a Kubernetes Job running
accelerate on every node), not by one service process; the service keeps the single-process jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from prorag import validation
from prorag.config import to_dict
from prorag.io import write_json
from prorag.training.context import local_context
from prorag.training.distributed import accelerator_from_env, check_engine, finish_distributed
from services.trainer.stages import check_job_config, get_stage, load_stage_modules, validate_config

#: stages whose work is the one training loop and whose outputs are written by the main process only (mcts
#: searches through the services and trains nothing: it runs on one process)
MULTI_PROCESS_STAGES = ("warmup", "sft", "prm", "rft", "rl", "dpo")


def check_device(cfg: Any, accelerator) -> None:
    """Point a launched process's stage at its own device: the config's ``auto`` (or ``cuda``) would put every
    process on the first GPU, so it becomes the device accelerate gave this process (cuda:<local rank>, or the
    CPU under --cpu). A config naming another device (one GPU, cuda:N, for every process; the CPU under a GPU
    launch) is refused."""
    if accelerator is None or not hasattr(cfg, "device"):
        return
    spec = (cfg.device or "auto").strip().lower()
    here = accelerator.device
    if spec in ("auto", "cuda") and (spec == "auto" or here.type == "cuda"):
        cfg.device = str(here)
    elif spec != str(here) and not (spec == "cpu" and here.type == "cpu"):
        raise SystemExit(f"config device {cfg.device!r} is not this launched process's device ({here}): every "
                         "process computes on the device accelerate gives it; set device to auto")


def check_processes(cfg: Any, accelerator) -> None:
    """Refuse a launch whose process count does not divide the config's grad_accum, before any model is loaded or
    sample drawn: the loop would refuse it only at its first step (prorag.training.loop.run_loop), after a
    multi-node job had loaded Qwen3-8B on every node and, for RFT, sampled for hours."""
    if accelerator is None:
        return
    k, world = int(getattr(cfg, "grad_accum", 1) or 1), accelerator.num_processes
    if k % world:
        raise SystemExit(f"config grad_accum ({k}) is not a multiple of the {world} launched processes (nodes x "
                         f"processes per node): each step's micro-batches are split evenly over them; launch "
                         f"{', '.join(str(n) for n in range(1, k + 1) if k % n == 0)} processes, or raise grad_accum")


def run_stage(stage_name: str, raw: dict, work_dir: str | Path, accelerator, *,
              emit: Callable[[dict], None] | None = None, stop: threading.Event | None = None) -> dict:
    """Run ``stage_name`` with config ``raw`` in ``work_dir`` on this process (one of a launch's processes when
    ``accelerator`` is given); returns the stage's result on the main process ({} on the others, or when stopped)
    and writes it to work_dir/result.json. emit: the main process's progress events (default: the log); stop: set
    it to make the stage checkpoint and return at its next step, as the trainer service does when it stops."""
    from services.trainer.server import TrainerConfig  # the server's module (grpc): only a launched job reads it
    load_stage_modules()
    stage = get_stage(stage_name)
    cfg = validate_config(stage, raw)
    allowed = validation.check_allowed_endpoints(TrainerConfig().allowed_endpoints)
    check_job_config(stage, to_dict(cfg), roots=validation.data_roots(), allowed_endpoints=allowed)
    if accelerator is not None and stage_name not in MULTI_PROCESS_STAGES:
        raise SystemExit(f"stage {stage_name!r} runs on one process (it trains nothing); launched on several: "
                         f"{', '.join(MULTI_PROCESS_STAGES)}")
    check_processes(cfg, accelerator)
    check_engine(accelerator)
    work = Path(work_dir)
    main = accelerator is None or accelerator.is_main_process
    if main:
        ctx = local_context(work, cfg, emit, stage=stage_name, stop=stop)
    if accelerator is not None:
        accelerator.wait_for_everyone()  # the main process has set up (or cleared) the shared checkpoints
        if not main:
            # its own scratch (run dir) so no two processes write one file; the job's checkpoints are the main's
            ctx = local_context(work / f"rank-{accelerator.process_index}", cfg, stage=stage_name,
                                emit=lambda event: None)
            ctx.shared_checkpoint_dir = work / "checkpoints"
    ctx.accelerator = accelerator
    check_device(ctx.config, accelerator)
    out = stage.fn(ctx) or {}
    if main:
        write_json(work / "result.json", out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.trainer.launch", description=__doc__.splitlines()[0])
    p.add_argument("stage", help="a trainer stage (" + ", ".join(MULTI_PROCESS_STAGES) + ", mcts on one process)")
    p.add_argument("config", help="the job config as a JSON file")
    p.add_argument("work_dir", help="checkpoints, run outputs and result.json go here (same dir = resume)")
    p.add_argument("--cpu", action="store_true", help="the CPU (gloo) backend even where CUDA is present")
    args = p.parse_args(argv)

    raw = json.loads(Path(args.config).read_text())
    accelerator = accelerator_from_env(cpu=True if args.cpu else None)
    main_process = accelerator is None or accelerator.is_main_process
    out = run_stage(args.stage, raw, args.work_dir, accelerator)
    if main_process:
        print(json.dumps(out, default=str))
    finish_distributed(accelerator)
    return 0 if out or not main_process else 1


if __name__ == "__main__":
    sys.exit(main())
