"""The RL stage against real retriever, policy and PRM servers on loopback, on the tiny world: each iteration
publishes the adapter as a new version and pushes it to the policy, which samples with it; stale trajectories
are dropped; advantages reach only generated tokens; beta = 0 is outcome-only GRPO; and the update itself, on
the tiny model, raises the log-probability of tokens with a positive advantage.

The policy server runs the MCTS test's scripted engine (GoldWalkEngine: steps right 60% of the time, log-probs
-0.5), because a policy that writes valid steps takes training a unit test cannot spend; it records which
adapter each generation ran under (its LoRA weights are not applied: the engine has none). Everything else,
the adapter registry, the policy's adapter manager and the PRM model, is real."""

from __future__ import annotations

import pytest
import torch

from prorag.config import ConfigError, from_dict
from prorag.rpc.service import ServeConfig
from prorag.training.context import local_context
from services.trainer.stage_rlpool import RLPoolConfig
from tests.services.trainer.scripted_stack import stack_fixture, training_stage_config
from tests.services.trainer.test_mcts_stage import GoldWalkEngine


class RecordingGoldWalk(GoldWalkEngine):
    """GoldWalkEngine that answers the adapter manager's one-token warm-up and records the adapter of each call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str | None] = []
        self.sampling: list[tuple[int, float]] = []  # (n, temperature) of each call
        self.tempered: list[bool] = []  # whether each call asked for tempered log-probs

    def generate(self, prompts, params, adapter=None, seeds=None):
        from prorag.engine import GeneratedSeq
        from prorag.rollout import decode

        if not any(decode(self.tokenizer, p).startswith(h) for p in prompts for h in self.by_prompt):
            return [[GeneratedSeq([0], [-0.5], "length", 0)] * params.n for _ in prompts]  # the warm-up
        self.calls.append(adapter)
        self.sampling.append((params.n, params.temperature))
        self.tempered.append(params.tempered_logprobs)
        return super().generate(prompts, params, adapter, seeds)


services = stack_fixture("rl", RecordingGoldWalk)


def _config(services, **kw):
    from services.trainer.stage_rl import RLConfig

    return training_stage_config(RLConfig, services, **{
        "max_questions": 4, "group_size": 4, "questions_per_iteration": 2, "iterations": 2, "lora_r": 4,
        "lora_alpha": 8, "lr": 1e-3, **kw})


def _journal(work):
    import json

    return [json.loads(line) for line in (work / "run" / "iterations.jsonl").read_text().splitlines()]


def test_each_iteration_publishes_pushes_and_samples_with_a_new_adapter_version(services, tmp_path, one_thread):
    from prorag.rpc.clients import PolicyClient
    from prorag.registry import ArtifactRef, registry, weights_sha256
    from services.trainer.stage_rl import run_rl

    engine = services["engine"]
    engine.calls.clear()
    work = tmp_path / "rl-push"
    out = run_rl(local_context(work, _config(services, recompute_old_logprobs=True), stage="rl"))
    job = work.name
    adapters = registry("adapter", "tiny")
    versions = [r.version for r in adapters.list() if r.name == "rl" and r.version.startswith(job + "-")]
    assert sorted(versions) == [f"{job}-0", f"{job}-1", f"{job}-2"]  # the start, after each of 2 updates
    assert out["adapter"] == f"rl@{job}-2" and out["iterations"] == 2 and out["push_acked"] == 1.0
    # every update changed the LoRA weights (B starts at zero, so version 0 is the base itself)
    shas = [weights_sha256(adapters.path(ArtifactRef("rl", v))) for v in sorted(versions)]
    assert len(set(shas)) == 3
    # the policy hot-loaded each version and samples with the newest; older ones past the lag bound are unloaded
    with PolicyClient(services["policy"]) as c:
        listed = c.list_adapters()
    assert listed.active == f"rl@{job}-2"
    assert [f"{a.ref.name}@{a.ref.version}" for a in listed.adapters if a.ref.version.startswith(job)] == \
        [f"rl@{job}-2"]
    # iteration i's rollouts ran under version i, and every trajectory was kept (strictly on-policy)
    rows = _journal(work)
    assert [r["adapter"] for r in rows] == [f"rl@{job}-0", f"rl@{job}-1"]
    assert all(r["acks"] and all(a["ok"] for a in r["acks"]) for r in rows)
    assert {a for a in engine.calls} == {f"rl@{job}-0", f"rl@{job}-1"}
    for r in rows:
        assert r["sampled"] == 2 * 4 == r["kept"] and r["dropped_stale"] == 0 and r["lag_max"] == 0
        assert r["prm_scored"] == r["kept"] and r["prm_version"]
        for key in ("reward_mean", "f1_mean", "format_valid_rate", "adv_std", "clip_fraction", "approx_kl",
                    "rollout_s", "update_s", "push_s", "update_skipped"):
            assert key in r
        assert 0 <= r["update_skipped"] <= r["kept"]
        assert 0.0 <= r["f1_mean"] <= 1.0 and r["trained_tokens"] > 0
        assert 0 <= r["deep_groups_uncredited"] <= min(r["groups_uncredited"], r["deep_groups"]) <= r["groups"] == 2
        if r["f1_mean"] == 0.0:
            assert r["groups_uncredited"] == r["groups"]
    # old log-probs recomputed by the same weights: the first iteration's ratio is exactly 1, nothing clipped
    assert rows[0]["clip_fraction"] == 0.0 and abs(rows[0]["approx_kl"]) < 1e-5
    assert out["total_kept"] == 16.0


def test_tempered_logprobs_are_asked_of_the_policy_and_need_no_recompute(services, tmp_path, one_thread):
    """With tempered_logprobs the rollouts ask the policy for the log-probs of the distribution they sample from
    (the policy engines return them; a vLLM policy started for raw ones refuses), so the trainer need not recompute
    them; off, they ask for raw ones."""
    from services.trainer.stage_rl import run_rl

    engine = services["engine"]
    for tempered in (True, False):
        engine.tempered.clear()
        engine.sampling.clear()
        cfg = _config(services, iterations=1, temperature=0.5, tempered_logprobs=tempered)
        assert not cfg.recompute_old_logprobs  # no longer required alongside
        out = run_rl(local_context(tmp_path / f"rl-tempered-{tempered}", cfg, stage="rl"))
        assert out["iterations"] == 1
        assert engine.tempered and set(engine.tempered) == {tempered}
        assert {t for _, t in engine.sampling} == {0.5}


def test_a_trajectory_older_than_max_policy_lag_is_dropped(services, tmp_path, one_thread):
    from prorag.rpc.clients import PolicyClient
    from services.trainer.stage_rl import run_rl

    def replica_falls_behind(work):
        # after the push of version 1, the replica goes back to version 0, as one the push missed would serve
        def emit(ev):
            if ev.get("message", "").startswith(f"pushed rl@{work.name}-1 "):
                with PolicyClient(services["policy"]) as c:
                    c.activate_adapter("rl", f"{work.name}-0")
        return emit

    strict = tmp_path / "rl-lag0"
    run_rl(local_context(strict, _config(services, rollout_adapter="active"), emit=replica_falls_behind(strict),
                         stage="rl"))
    first, second = _journal(strict)
    assert first["dropped_stale"] == 0 and first["kept"] == 8
    assert second["sampled"] == second["dropped_stale"] == 8 and second["kept"] == 0  # one version behind: dropped
    assert second["trained_tokens"] == 0
    loose = tmp_path / "rl-lag1"
    out = run_rl(local_context(loose, _config(services, rollout_adapter="active", max_policy_lag=1),
                               emit=replica_falls_behind(loose), stage="rl"))
    _, second = _journal(loose)
    assert second["kept"] == 8 and second["dropped_stale"] == 0 and second["lag_mean"] == 1.0
    assert out["lag_max"] == 1.0


def test_a_stopped_job_resumes_from_its_checkpoint_and_republishes_nothing_new(services, tmp_path, one_thread):
    import threading

    from prorag.registry import registry
    from services.trainer.stage_rl import run_rl

    cfg = _config(services, iterations=3, checkpoint_every=1, rollout_adapter="pinned")
    work = tmp_path / "rl-resume"
    stop = threading.Event()

    def emit(ev):
        if ev.get("message", "").startswith("iteration 1/3"):
            stop.set()  # the trainer stops after the first iteration's update

    assert run_rl(local_context(work, cfg, emit=emit, stop=stop, stage="rl")) == {}
    job = work.name
    mine = lambda: sorted(r.version for r in registry("adapter", "tiny").list() if r.version.startswith(job + "-"))
    assert mine() == [f"{job}-0"]
    resumed = []
    out = run_rl(local_context(work, cfg, emit=lambda ev: resumed.append(ev), stage="rl"))
    assert any(ev.get("resumed_from_step") == 1 for ev in resumed)
    # version 1 is the checkpoint's weights, published once; no ".r1" republication was needed
    assert mine() == [f"{job}-{i}" for i in range(4)] and out["adapter"] == f"rl@{job}-3"
    assert [r["iteration"] for r in _journal(work)] == [0, 1, 2]
    # pinned requests name the version being trained: each iteration sampled from exactly it
    assert [r["adapter"] for r in _journal(work)] == [f"rl@{job}-{i}" for i in range(3)]
    assert all(r["lag_max"] == 0 and r["kept"] == 8 for r in _journal(work))
    # the resumed job ends on the adapter an uninterrupted run of the same config ends on
    straight = run_rl(local_context(tmp_path / "rl-straight", cfg, stage="rl"))
    from safetensors.torch import load_file

    adapters = registry("adapter", "tiny")
    a, b = (load_file(str(adapters.resolve(ref) / "adapter_model.safetensors"))
            for ref in (out["adapter"], straight["adapter"]))
    assert a.keys() == b.keys() and a
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)  # trained: B starts at zero
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_mini_batches_take_several_steps_per_rollout_and_resume_inside_an_iteration(services, tmp_path, one_thread):
    import threading

    from prorag.registry import registry
    from services.trainer.stage_rl import run_rl

    cfg = _config(services, iterations=3, checkpoint_every=1, rollout_adapter="pinned", mini_batches=2)
    work = tmp_path / "rl-mini"
    stop = threading.Event()
    job = work.name

    def emit(ev):
        # iteration 1's adapter is pushed inside its first mini-batch's step: the loop stops before its second
        if ev.get("message", "").startswith(f"pushed rl@{job}-1 "):
            stop.set()

    assert run_rl(local_context(work, cfg, emit=emit, stop=stop, stage="rl")) == {}
    saved = work / "checkpoints" / "rl-iteration-1.pt"
    assert saved.exists(), "the interrupted iteration's rollouts were not kept for the resume"
    resumed = []
    out = run_rl(local_context(work, cfg, emit=resumed.append, stage="rl"))
    assert any(ev.get("resumed_from_step") == 3 for ev in resumed)  # 2 steps of iteration 0, 1 of iteration 1
    # iteration 1 was not rolled out again: no second push of its version, each iteration journaled once
    mine = sorted(r.version for r in registry("adapter", "tiny").list() if r.version.startswith(job + "-"))
    assert mine == [f"{job}-{i}" for i in range(4)]
    assert [r["iteration"] for r in _journal(work)] == [0, 1, 2]
    steps = [ev["step"] for ev in resumed if "loss" in ev]
    assert steps and max(steps) == 6  # 3 iterations x 2 optimizer steps
    straight = run_rl(local_context(tmp_path / "rl-mini-straight", cfg, stage="rl"))
    a = _assert_same_adapter(out["adapter"], straight["adapter"])
    # and two steps per iteration are not one: the same rollouts with one mini-batch end elsewhere
    single = run_rl(local_context(tmp_path / "rl-single", _config(services, iterations=3, rollout_adapter="pinned"),
                                  stage="rl"))
    c = _adapter_weights(single["adapter"])
    assert any(not torch.allclose(a[key], c[key], atol=1e-6) for key in a)


class _Killed(BaseException):
    """What the job sees of kill -9: it stops where it is, with no stop request, so nothing is saved on the way out."""


def test_a_job_killed_between_checkpoints_resumes_to_the_uninterrupted_adapter(services, tmp_path, one_thread):
    from services.trainer.stage_rl import run_rl

    cfg = _config(services, iterations=4, checkpoint_every=2, rollout_adapter="pinned")
    work = tmp_path / "rl-killed"
    job = work.name

    def emit(ev):
        # iteration 3's adapter is published and pushed, the last checkpoint is iteration 2's: the kill lands
        # after a version and a journal row the checkpoint has not seen
        if ev.get("message", "").startswith(f"pushed rl@{job}-3 "):
            raise _Killed()

    with pytest.raises(_Killed):
        run_rl(local_context(work, cfg, emit=emit, stage="rl"))
    assert [r["iteration"] for r in _journal_rows(work)] == [0, 1, 2]
    resumed = []
    out = run_rl(local_context(work, cfg, emit=resumed.append, stage="rl"))
    assert any(ev.get("resumed_from_step") == 2 for ev in resumed)
    assert [r["iteration"] for r in _journal(work)] == [0, 1, 2, 3]  # the unseen row 2 was rolled out again
    assert all(r["lag_max"] == 0 for r in _journal(work))
    straight = run_rl(local_context(tmp_path / "rl-unkilled", cfg, stage="rl"))
    _assert_same_adapter(out["adapter"], straight["adapter"])


def test_kill_dash_nine_of_the_trainer_during_rl_resumes_to_the_uninterrupted_adapter(services, tmp_path,
                                                                                     one_thread):
    """The trainer as a real process, killed with SIGKILL after a checkpoint and a later published version, then
    started again: the job resumes on its own and publishes the adapter an uninterrupted run publishes."""
    import os

    from prorag.rpc.clients_trainer import TrainerClient, state_name
    from services.trainer.stage_rl import run_rl
    from tests.helpers import free_port
    from tests.services.trainer.test_kill_resume import Trainer

    cfg = _config(services, iterations=4, checkpoint_every=2, rollout_adapter="pinned", threads=1)
    job_id = "rl-kill9"
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    # the trainer publishes into the registry the policy service loads adapters from
    trainer = Trainer(home, port, env={"PRORAG_DATA": os.environ["PRORAG_DATA"]})
    trainer.start()
    try:
        with TrainerClient(f"127.0.0.1:{port}", timeout=30) as tc:
            tc.start("rl", {**cfg.__dict__, "tracking": "local"}, job_id=job_id)
            killed, messages = False, []
            for ev in tc.watch(job_id, timeout=600):
                messages.append(ev.message)
                # version 3 is out and the last checkpoint is iteration 2's (checkpoint_every 2)
                if not killed and ev.message.startswith(f"pushed rl@{job_id}-3 "):
                    trainer.kill()
                    killed = True
                    trainer.start()
            job = tc.wait(job_id, timeout=600)
    finally:
        trainer.terminate()
    logs = "\n".join(p.read_text() for p in trainer.logs)
    assert killed, "the job finished before version 3 was pushed"
    assert state_name(job.state) == "SUCCEEDED", (job.error, logs[-3000:])
    # it resumed from the checkpoint (not from scratch), re-published version 2 for the policy to sample with, and
    # ran iteration 3 again: the journal row written after the checkpoint is not trusted
    after = messages[messages.index(f"pushed rl@{job_id}-3 to 1/1 replica(s)") + 1:]
    assert any(m.startswith("re-queued after a trainer restart") for m in after)
    assert "resumed from step 2" in after and f"pushed rl@{job_id}-2 to 1/1 replica(s)" in after
    assert sum(m.startswith("iteration 4/4") for m in messages) == 1
    straight = run_rl(local_context(tmp_path / "rl-kill9-straight", cfg, stage="rl"))
    _assert_same_adapter(job.outputs["adapter"], straight["adapter"])


def _adapter_weights(ref: str) -> dict:
    from safetensors.torch import load_file

    from prorag.registry import registry

    return load_file(str(registry("adapter", "tiny").resolve(ref) / "adapter_model.safetensors"))


def _assert_same_adapter(ref_a: str, ref_b: str) -> dict:
    """The two published adapters hold the same weights (to 1e-6); returns the first's."""
    a, b = _adapter_weights(ref_a), _adapter_weights(ref_b)
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    return a


def _journal_rows(work):
    import json

    return [json.loads(line) for line in (work / "checkpoints" / "rl-iterations.jsonl").read_text().splitlines()]


def _push_zero_adapter(services, tmp_path, job):
    """Publish and activate a fresh (zero) LoRA as rl@<job>-0, the adapter collect() is told it trains."""
    from prorag.rpc.clients import push_adapter
    from prorag.modeling import load_policy
    from prorag.registry import weights_sha256
    from prorag.training.lora import build_lora, publish_adapter

    cfg = _config(services)
    model, _ = load_policy(services["base"])
    version = publish_adapter(build_lora(model, cfg), "tiny", "rl", f"{job}-0", base=services["base"],
                              base_sha=weights_sha256(services["base"]), scratch=tmp_path, config={}, step=0)
    assert all(a.ok for a in push_adapter(services["policy"], "rl", version))
    return f"rl@{version}"


def test_advantages_reach_only_generated_tokens_and_beta_zero_is_outcome_only(services, tmp_path, one_thread):
    from prorag import paths
    from prorag.rpc.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from services.trainer.stage_rl import collect

    key = _push_zero_adapter(services, tmp_path, "collect")
    qs = load_split(paths.world_dir("tiny"), "train")[:3]
    with PolicyClient(services["policy"]) as policy, PRMClient(services["prm"]) as prm:
        full = collect(_config(services), qs, 0, "collect", key, policy, prm)
        beta0 = collect(_config(services, beta=0.0), qs, 0, "collect", key, policy, prm)
        no_prm = collect(_config(services, prm=""), qs, 0, "collect", key, policy, None)
    assert full.stats["kept"] == 12 and full.stats["prm_scored"] == 12
    assert beta0.stats["prm_scored"] == no_prm.stats["prm_scored"] == 0  # beta 0 does not even ask the PRM
    for s in full.samples:
        for g, m, a, lp in zip(s.generated_mask, s.loss_mask, s.advantages, s.old_logprobs):
            if not g:  # prompt, retrieved documents, glue: no loss, no advantage
                assert m == 0.0 and a == 0.0
            else:  # the sampling log-probs are the policy service's (the scripted engine's -0.5)
                assert m == 1.0 and lp == -0.5
    # same seeded rollouts; beta 0 and no PRM give identical advantages: each rollout's outcome on all its tokens
    assert [s.token_ids for s in beta0.samples] == [s.token_ids for s in no_prm.samples] == \
        [s.token_ids for s in full.samples]
    assert [s.advantages for s in beta0.samples] == [s.advantages for s in no_prm.samples]
    for s in beta0.samples:
        assert len({a for a, m in zip(s.advantages, s.loss_mask) if m}) == 1
    # the process term makes steps of one rollout differ where the PRM scored them differently
    assert any(len({round(a, 6) for a, m in zip(s.advantages, s.loss_mask) if m}) > 1 for s in full.samples)
    assert [s.reward for s in full.samples] == [s.reward for s in beta0.samples]


def test_an_update_raises_the_log_prob_of_positive_advantage_tokens(services, one_thread):
    """The real gradient path on the tiny model: a fixed batch, half its generated tokens with advantage +1 and
    half -1; after a few AdamW steps on rl_loss the first rise, the second fall, and the loss goes down."""
    import torch

    from prorag.modeling import load_policy
    from prorag.training.lora import RLSample, build_lora, collate_rl, rl_loss, token_logprobs

    torch.manual_seed(0)
    cfg = _config(services, lora_r=8, lora_alpha=16, lr=5e-3)
    model, tok = load_policy(services["base"])
    model = build_lora(model, cfg)
    ids = tok.encode("Who founded Kest?<step>\nI search.</step>\n<subquery>\nKest founder</subquery>",
                     add_special_tokens=False)
    n = len(ids)
    gen = [0] * 4 + [1] * (n - 4)
    half = 4 + (n - 4) // 2
    adv = [0.0] * 4 + [1.0] * (half - 4) + [-1.0] * (n - half)
    sample = RLSample(ids, gen, adv, [float(g) for g in gen], [0.0] * n)
    batch = collate_rl([sample], tok.pad_token_id)
    with torch.no_grad():
        before = token_logprobs(model, batch[0], batch[1], batch[3])[0]
    batch[4][:] = before  # on-policy: the old log-probs are the current ones
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    losses = []
    for _ in range(3):
        loss, stats = rl_loss(model, batch, cfg)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert stats["tokens"] == n - 4
    with torch.no_grad():
        after = token_logprobs(model, batch[0], batch[1], batch[3])[0]
    pos, neg = slice(4, half), slice(half, n)
    assert float(after[pos].sum()) > float(before[pos].sum())
    assert float(after[neg].sum()) < float(before[neg].sum())
    assert losses[-1] < losses[0]
    # only LoRA weights train; the KL to the base (adapter disabled) is 0 before any step and positive after
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    fresh = build_lora(load_policy(services["base"])[0], cfg)
    _, st0 = rl_loss(fresh, batch, _config(services, kl_coef=0.1))
    _, st1 = rl_loss(model, batch, _config(services, kl_coef=0.1))
    assert st0["kl"] == pytest.approx(0.0, abs=1e-7) and st1["kl"] > 0


def test_recomputed_log_probs_match_a_real_engines_sampling_log_probs(services, one_thread):
    """The ratio's premise: on the tiny model served by the real transformers engine, the local LoRA model (zero
    B, so the base itself) gives each generated token of a rollout the log-prob the engine sampled it with. (The
    untrained tiny base writes one unfinished step; spans after insertions are covered with the scripted engine.)"""
    import torch

    from prorag.rpc.clients import PolicyClient
    from prorag.modeling import load_policy
    from prorag.rpc.pbconv import token_trace_from_pb
    from services.policy.server import PolicyConfig, start as start_policy
    from prorag.training.lora import RLSample, build_lora, collate_rl, token_logprobs

    loop = services["loop"]
    # the base itself, never an adapter the world's adapter root records as active for it: the tests' bases are
    # copies of one build, so an RL test before this one in the same worker may have activated one for its weights
    real = loop.run(start_policy(ServeConfig(port=0, http_port=-1),
                                 PolicyConfig(model=services["base"], world="tiny", retriever=services["retriever"],
                                              restore_active=False)))
    try:
        with PolicyClient(f"127.0.0.1:{real.grpc_port}") as c:
            trajs = [t for t in c.rollout([("q", "Who founded Kest?")], c.sampling(n=2, temperature=1.0, max_tokens=24,
                                                                                  seed=11), max_steps=3, topk=1)
                     if hasattr(t, "question_id")]
    finally:
        loop.run(real.stop())
    model, tok = load_policy(services["base"])
    model = build_lora(model, _config(services))
    for t in trajs:
        tr = token_trace_from_pb(t.trace, t.prompt_length)
        gen = [float(g) for g in tr.generated_mask]
        assert sum(gen) > 0
        b = collate_rl([RLSample(tr.token_ids, tr.generated_mask, [0.0] * len(gen), gen, tr.logprobs)],
                       tok.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(model, b[0], b[1], b[3])[0]
        mask = torch.tensor(gen) > 0
        # an off-by-one position would be off by whole nats, not by float rounding
        assert torch.allclose(lp[mask], torch.tensor(tr.logprobs)[mask], atol=1e-4)


def test_the_configs_choices_are_the_tables_names():
    import dataclasses

    from prorag.algorithms.rl import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from services.trainer.rl_collect import STEP_SCORERS
    from services.trainer.stage_rl import RLConfig

    choices = {f.name: set(f.metadata["choices"] or ()) for f in dataclasses.fields(RLConfig)}
    assert choices["step_scorer"] == set(STEP_SCORERS)
    assert choices["advantage"] == set(ADVANTAGE_ESTIMATORS) and choices["policy_loss"] == set(POLICY_LOSSES)


def test_policy_lag_reads_this_jobs_versions_only():
    from services.trainer.stage_rl import policy_lag

    assert policy_lag("rl@job-3", "rl", "job", 5) == 2
    assert policy_lag("rl@job-5.r1", "rl", "job", 5) == 0  # republished by a resumed attempt
    assert policy_lag("", "rl", "job", 5) is None  # the base model
    assert policy_lag("rl@other-5", "rl", "job", 5) is None and policy_lag("sft@job-5", "rl", "job", 5) is None
    assert policy_lag("rl@job-x-5", "rl", "job", 5) is None


def test_min_hops_keeps_deep_questions_before_max_questions_cuts():
    from types import SimpleNamespace

    from services.trainer.stage_rl import select_questions

    qs = [SimpleNamespace(id=f"q{i}", hops=h) for i, h in enumerate([1, 3, 2, 4, 3, 1])]
    assert [q.id for q in select_questions(qs)] == [q.id for q in qs]
    assert [q.id for q in select_questions(qs, min_hops=3)] == ["q1", "q3", "q4"]
    assert [q.id for q in select_questions(qs, min_hops=3, max_questions=2)] == ["q1", "q3"]
    assert [q.id for q in select_questions(qs, max_questions=2)] == ["q0", "q1"]
    assert select_questions(qs, min_hops=5) == []


@pytest.mark.parametrize("split", ["test", "test_deep", "heldout_deep"])
def test_rl_never_trains_on_a_split_the_final_figures_are_read_on(services, split):
    with pytest.raises(ConfigError, match=f"RL never trains on '{split}'.*'rl_deep'"):
        _config(services, split=split)
    with pytest.raises(ConfigError, match=f"never draws on '{split}'"):
        from_dict(RLPoolConfig, {"policy_model": "m", "split": split})


def test_non_finite_prm_scores_stop_the_iteration_before_any_update(services, tmp_path, one_thread):
    """A broken PRM (a real one whose head weights are NaN, served by a real PRM server) must not turn into
    NaN advantages and weights: collect() stops naming the trajectory and the PRM, before any update."""
    import torch

    from prorag import paths
    from prorag.rpc.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from prorag.errors import FailedPrecondition
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from services.prm.engine import PRMEngine
    from services.prm.server import PRMServeConfig, start as start_prm
    from services.trainer.stage_rl import collect

    broken, tok = prm_from_policy(services["base"], seed=2)
    with torch.no_grad():
        broken.score.weight.fill_(float("nan"))
    save_pretrained(broken, tok, tmp_path / "nan-prm")
    loop = services["loop"]
    srv = loop.run(start_prm(ServeConfig(port=0), PRMServeConfig(), engine=PRMEngine(tmp_path / "nan-prm")))
    try:
        key = _push_zero_adapter(services, tmp_path, "nanprm")
        qs = load_split(paths.world_dir("tiny"), "train")[:2]
        with PolicyClient(services["policy"]) as policy, PRMClient(f"127.0.0.1:{srv.grpc_port}") as prm:
            with pytest.raises(FailedPrecondition, match=r"non-finite advantages.*no update was made"):
                collect(_config(services), qs, 0, "nanprm", key, policy, prm)
            # outcome-only GRPO does not ask the PRM, so the same broken PRM cannot stop it
            assert collect(_config(services, beta=0.0), qs, 0, "nanprm", key, policy, prm).stats["kept"] == 8
    finally:
        loop.run(srv.stop())


def test_a_prm_service_that_restarts_mid_iteration_is_waited_for_and_asked_again(services, tmp_path, one_thread):
    """The PRM server goes away before the iteration's scoring call and comes back on the same port once that call
    has found it down: collect() waits for its health, asks again, and the iteration is whole (every trajectory
    scored once)."""
    import threading
    import time

    from prorag import paths
    from prorag.rpc.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from services.prm.engine import PRMEngine
    from services.prm.server import PRMServeConfig, start as start_prm
    from services.trainer.stage_rl import collect
    from tests.helpers import free_port

    prm_model, tok = prm_from_policy(services["base"], seed=4)
    save_pretrained(prm_model, tok, tmp_path / "prm")
    loop, port = services["loop"], free_port()
    srv = loop.run(start_prm(ServeConfig(port=port), PRMServeConfig(), engine=PRMEngine(tmp_path / "prm")))
    loop.run(srv.stop())  # down before the iteration scores its steps
    back, asked = {}, threading.Event()

    class FirstCallSeen(PRMClient):
        def score(self, inputs, timeout=None):
            asked.set()  # on a timer the PRM could be back before a slow rollout ended: no wait, nothing tested
            return super().score(inputs, timeout)

    def restart():
        asked.wait(300)
        time.sleep(0.5)
        back["srv"] = loop.run(start_prm(ServeConfig(port=port), PRMServeConfig(), engine=PRMEngine(tmp_path / "prm")))

    threading.Thread(target=restart, daemon=True).start()
    key = _push_zero_adapter(services, tmp_path, "prmback")
    qs = load_split(paths.world_dir("tiny"), "train")[:2]
    try:
        with PolicyClient(services["policy"]) as policy, FirstCallSeen(f"127.0.0.1:{port}") as prm:
            data = collect(_config(services, prm=f"127.0.0.1:{port}", service_wait_s=60), qs, 0, "prmback", key,
                           policy, prm)
        assert data.stats["service_retries"] >= 1
        assert data.stats["kept"] == data.stats["prm_scored"] == 8
        # a service that stays down fails the iteration once the wait is spent: UNAVAILABLE, naming it and where
        loop.run(back.pop("srv").stop())
        from prorag.errors import Unavailable

        with PolicyClient(services["policy"]) as policy, PRMClient(f"127.0.0.1:{port}") as prm:
            with pytest.raises(Unavailable, match=f"PRM service at 127.0.0.1:{port} went away .* did not come back "
                                                  "within service_wait_s=1s"):
                collect(_config(services, prm=f"127.0.0.1:{port}", service_wait_s=1), qs, 0, "prmback", key,
                        policy, prm)
    finally:
        if "srv" in back:
            loop.run(back["srv"].stop())


class SometimesSilent(RecordingGoldWalk):
    """RecordingGoldWalk whose first step is, for some samples, no token at all (as an engine returns when a
    trajectory has reached the context limit) or only blanks: steps with nothing to read."""

    def generate(self, prompts, params, adapter=None, seeds=None):
        from prorag.engine import GeneratedSeq
        from prorag.rollout import decode

        out = super().generate(prompts, params, adapter, seeds)
        for i, p in enumerate(prompts):
            text = decode(self.tokenizer, p)
            head = next((h for h in self.by_prompt if text.startswith(h)), None)
            if head is not None and "</step>" not in text[len(head):]:  # the first step of a trajectory
                # every other sample (samples come as repeated prompts with their own seeds)
                blank = self.tokenizer.encode("  \n ", add_special_tokens=False)
                out[i] = [(GeneratedSeq([], [], "length", None) if (i // 2) % 2 else
                           GeneratedSeq(blank, [-0.5] * len(blank), "length", None)) if (i + j) % 2 else s
                          for j, s in enumerate(out[i])]
        return out


def test_empty_sampled_steps_are_not_sent_to_the_prm_and_score_as_invalid(tmp_path_factory, one_thread):
    import math

    from prorag import paths
    from prorag.rpc.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from services.trainer.stage_rl import collect
    from tests.services.trainer.scripted_stack import scripted_stack

    with scripted_stack(tmp_path_factory.mktemp("rl-empty") / "data", SometimesSilent) as stack:
        key = _push_zero_adapter(stack, tmp_path_factory.mktemp("rl-empty-scratch"), "empty")
        qs = load_split(paths.world_dir("tiny"), "train")[:2]
        with PolicyClient(stack["policy"]) as policy, PRMClient(stack["prm"]) as prm:
            data = collect(_config(stack), qs, 0, "empty", key, policy, prm)
    assert data.stats["empty_steps"] > 0 and data.stats["kept"] == 8
    assert 0 < data.stats["prm_scored"] < 8  # trajectories whose only step is empty ask the PRM nothing
    assert all(math.isfinite(a) for s in data.samples for a in s.advantages)



def test_rl_trains_float32_adapters_over_a_bfloat16_base_on_the_cpu(services, tmp_path, one_thread):
    from safetensors.torch import load_file

    from prorag.registry import registry
    from services.trainer.stage_rl import run_rl

    events = []
    out = run_rl(local_context(tmp_path / "rl-bf16", _config(services, iterations=1, dtype="bfloat16"),
                               emit=events.append, stage="rl"))
    assert {e["metrics"]["dtype"] for e in events if e.get("loss") is not None} == {"bfloat16"}
    assert out["iterations"] == 1 and out["total_kept"] > 0
    adapter = load_file(str(registry("adapter", "tiny").resolve(out["adapter"]) / "adapter_model.safetensors"))
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}
