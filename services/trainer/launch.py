"""One trainer stage outside the trainer service, on one process or on every process of a multi-GPU / multi-node
launch: ``python -m services.trainer.launch STAGE CONFIG.json WORK_DIR``.

Under ``accelerate launch`` (GPU hosts, with its config file choosing DDP, FSDP2 or DeepSpeed ZeRO-3) or torchrun
(RANK / WORLD_SIZE / MASTER_ADDR set), every process runs the stage with an ``accelerate.Accelerator`` on its
context: the one training loop splits each optimizer step's micro-batches over the processes, and only the main
process writes checkpoints, progress and what the stage publishes (prorag.training.distributed). The job config is
checked as the trainer service checks it (names, paths under the data roots, endpoints on the allowlist). A killed
launch started again with the same WORK_DIR and config resumes from its last checkpoint.

Why not inside the trainer service: a multi-node job is started by the cluster (a Kubernetes Job running
accelerate on every node), not by one service process; the service keeps the single-process jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


#: stages whose work is the one training loop and whose outputs are written by the main process only
MULTI_PROCESS_STAGES = ("sft",)


def main(argv: list[str] | None = None) -> int:
    from prorag import validation
    from prorag.config import to_dict
    from prorag.io import write_json
    from prorag.training.context import local_context
    from prorag.training.distributed import accelerator_from_env, finish_distributed
    from services.trainer.server import TrainerConfig
    from services.trainer.stages import check_job_config, get_stage, load_stage_modules, validate_config

    p = argparse.ArgumentParser(prog="python -m services.trainer.launch", description=__doc__.splitlines()[0])
    p.add_argument("stage", help="a trainer stage (sft, rft, rl, prm, ...)")
    p.add_argument("config", help="the job config as a JSON file")
    p.add_argument("work_dir", help="checkpoints, run outputs and result.json go here (same dir = resume)")
    p.add_argument("--cpu", action="store_true", help="the CPU (gloo) backend even where CUDA is present")
    args = p.parse_args(argv)

    load_stage_modules()
    stage = get_stage(args.stage)
    raw = json.loads(Path(args.config).read_text())
    cfg = validate_config(stage, raw)
    allowed = validation.check_allowed_endpoints(TrainerConfig().allowed_endpoints)
    check_job_config(stage, to_dict(cfg), roots=validation.data_roots(), allowed_endpoints=allowed)
    accelerator = accelerator_from_env(cpu=True if args.cpu else None)
    if accelerator is not None and args.stage not in MULTI_PROCESS_STAGES:
        raise SystemExit(f"stage {args.stage!r} runs on one process for now (its sampling through the services is "
                         f"not split over processes); launched on several: {', '.join(MULTI_PROCESS_STAGES)}")
    work = Path(args.work_dir)
    if accelerator is None or accelerator.is_main_process:
        ctx = local_context(work, cfg, stage=args.stage)
    if accelerator is not None:
        accelerator.wait_for_everyone()  # the main process has set up (or cleared) the shared checkpoints
        if not accelerator.is_main_process:
            # its own scratch (data caches, run dir) so no two processes write one file; the main's checkpoints
            ctx = local_context(work / f"rank-{accelerator.process_index}", cfg, stage=args.stage,
                                emit=lambda event: None)
            ctx.shared_checkpoint_dir = work / "checkpoints"
    ctx.accelerator = accelerator
    out = stage.fn(ctx)
    if ctx.is_main:
        write_json(Path(args.work_dir) / "result.json", out or {})
        print(json.dumps(out or {}, default=str))
    finish_distributed(accelerator)
    return 0 if out or not ctx.is_main else 1


if __name__ == "__main__":
    sys.exit(main())
