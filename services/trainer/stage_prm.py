"""Stage "prm": the process reward model, trained with a Bradley-Terry loss on labelled sibling pairs.

Why not TRL's RewardTrainer: it pools one score per sequence (sequence classification) and owns its training
loop; here the score is read at each step's last token of the one rendering that scoring uses
(prorag.search.pairs.prm_inputs), so one forward pass later scores a whole trajectory, and the project's one loop
gives checkpoints, exact resume, cancellation and the same events as every other stage. The objective is the
same: -log sigmoid(r_chosen - r_rejected).

A pair's two renderings share the question, the earlier steps and their documents; by default
(pair_encoding "shared") the pair is one sequence holding that prefix once, the rejected step masked from the
chosen one and its positions restarting where the prefix ends, so each step scores as in its own sequence.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from prorag.algorithms.mcts import pair_kind
from prorag.algorithms.prm import (bradley_terry_loss, join_pair, left_truncate, left_truncate_steps, pairwise_accuracy,
                                   verdict_loss)
from prorag.config import ConfigError, cfg_field
from prorag.errors import FailedPrecondition
from prorag.modeling import prepare_for_training
from prorag.prm.model import BRANCH_ATTENTION, attn_implementation, prm_from_policy, score_batch, score_branched
from prorag.search.pairs import load_pairs, prm_rendering
from prorag.training.distributed import sharding_asked
from prorag.training.context import JobContext
from prorag.training.loop import accumulated_epochs, call_in_engine, run_loop
from prorag.training.run_config import TrainRunConfig
from services.trainer.stages import publish_trained, register_stage, resolve_model


@dataclass
class PRMConfig(TrainRunConfig):
    """Train a PRM (the policy's trunk with a scalar head) on labelled sibling pairs."""
    world: str = cfg_field("default", help="embedded world whose registry receives the PRM")
    pairs: str = cfg_field("", help="required: JSONL of sibling pairs (prorag.search.pairs.StepPair rows), e.g. the "
                                    "MCTS stage's output")
    extra_pairs: str = cfg_field("", help="a second JSONL of pairs trained on together with ``pairs`` (e.g. the "
                                          "siblings stage's beside the MCTS stage's; '' = none)")
    policy_model: str = cfg_field("", help="required: the policy directory (or published name@version in the "
                                           "world's model registry) whose trunk the PRM starts from (ProRAG: the "
                                           "SFT model)")
    label_source: str = cfg_field("judge", help="which label trains it: judge, value (margin) or both (only "
                                                "pairs where they agree)", choices=("judge", "value", "both"))
    holdout: float = cfg_field(0.1, help="share of questions whose pairs are held out for pairwise accuracy",
                               min=0.0, max=0.5)
    epochs: float = cfg_field(3.0, help="passes over the training pairs (ProRAG: 3)", min=0.01, max=100)
    batch_size: int = cfg_field(8, help="pairs per optimizer step", min=1, max=1024)
    grad_accum: int = cfg_field(1, help="micro-batches each step's pairs are split into (a launch on several "
                                        "processes needs a multiple of their count)", min=1, max=1024)
    lr: float = cfg_field(1e-4, help="peak learning rate (ProRAG: 2e-5 for an 8B model; small models take more)",
                          min=0.0, max=1.0)
    max_len: int = cfg_field(2048, help="longest input; longer ones are cut on the left, after the prompt",
                             min=16)
    publish_name: str = cfg_field("prm", help="publish as name@<job id> under data/prms/<world>")
    pair_encoding: str = cfg_field("shared", help="how a pair reaches the model: shared (one sequence, the shared "
                                                  "prefix once, the rejected step masked from the chosen one; same "
                                                  "scores, fewer tokens) or separate (two full sequences). shared "
                                                  "needs sdpa or eager attention; under flash_attention_2, and for "
                                                  "pairs sharing no tokens or longer than max_len, it is separate",
                                   choices=("shared", "separate"))

    verdict_weight: float = cfg_field(0.0, help="weight of a pointwise term beside Bradley-Terry: the judge's accepted "
                                                "step above 0, its rejected one below (prorag.algorithms.prm."
                                                "verdict_loss), so scores compare across step kinds and a score "
                                                "means something on its own; 0 = Bradley-Terry alone, as ProRAG "
                                                "trains it. Needs judge verdicts: label_source judge or both",
                                      min=0.0, max=100.0)
    likelihood_weight: float = cfg_field(0.0, help="add this weight times the trunk's own mean log-probability of a "
                                                   "step's written tokens (read through its tied embeddings) to the "
                                                   "head's score, in training and wherever the PRM scores "
                                                   "(prorag.prm.model); the SFT trunk already ranks sound steps above "
                                                   "corrupted ones by it. 0 = the head alone, as ProRAG scores. "
                                                   "Needs a policy with tied embeddings and no FSDP/DeepSpeed "
                                                   "sharding", min=0.0, max=100.0)

    def validate(self) -> None:
        super().validate()
        if self.verdict_weight and self.label_source == "value":
            raise ConfigError("verdict_weight", "needs the judge's verdicts (label_source judge or both): a value "
                                                "label says which sibling led to more reward, not that either is sound")
        if self.batch_size % self.grad_accum:
            raise ConfigError("grad_accum", f"must divide batch_size ({self.batch_size}), got {self.grad_accum}")


def _held_out(question_id: str, share: float) -> bool:
    # by question, so held-out pairs come from trees the PRM never saw
    return int(hashlib.sha256(question_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def encode_pairs(tokenizer, pairs, source: str) -> list[tuple[list[int], int, list[int], int, list[int], list[int]]]:
    """(chosen ids, chosen score position, rejected ids, rejected position, chosen written, rejected written) per
    labelled pair; written: the indices of the step's written tokens (prorag.search.pairs.prm_rendering)."""
    out = []
    for p in pairs:
        choice = p.label(source)
        if choice is None:
            continue
        encoded = [prm_rendering(tokenizer, p.question, [*p.context, p.steps[i]]) for i in (choice, 1 - choice)]
        (c_ids, c_pos, c_w), (r_ids, r_pos, r_w) = encoded
        out.append((c_ids, c_pos[-1], r_ids, r_pos[-1], c_w[-1], r_w[-1]))
    return out


def _written(pair) -> tuple[list[int] | None, list[int] | None]:
    # an encoded pair may come without written indices (chosen ids, position, rejected ids, position): a head-only PRM
    return (pair[4], pair[5]) if len(pair) > 4 else (None, None)


def pair_rows(batch, max_len: int, keep_prefix: int = 0, encoding: str = "shared"):
    """The rows one forward pass scores a batch of encoded pairs from: (sequences, branches, positions, written).

    encoding "shared": a pair whose two renderings share their first tokens is one row, the shared prefix once
    then the chosen and the rejected step's tokens (prorag.algorithms.prm.join_pair); the others, and every pair
    under "separate", two rows, each left-truncated to max_len after keep_prefix. Rows [R] of ids; branches [R]
    (prefix, first, second) counts (prorag.algorithms.prm.branch_attention); positions [R] of score indices: for
    pair k, chosen then rejected are read from the rows it owns, in order (see pair_scores); written [R], per
    position the step's written-token indices into the row (None when the batch carries none)."""
    seqs, branches, pos, written = [], [], [], []
    for pair in batch:
        c_ids, c_pos, r_ids, r_pos = pair[:4]
        c_w, r_w = _written(pair)
        joined = join_pair(c_ids, c_pos, r_ids, r_pos, max_len) if encoding == "shared" else None
        if joined is not None:
            ids, counts, c_at, r_at = joined
            seqs.append(ids)
            branches.append(counts)
            pos.append([c_at, r_at])
            if c_w is not None:
                n = counts[0]  # the rejected rendering's own tail follows the chosen one's in the joined row
                written.append([list(c_w), [i if i < n else len(c_ids) + i - n for i in r_w]])
            continue
        for ids, p, w in ((c_ids, c_pos, c_w), (r_ids, r_pos, r_w)):
            if w is None:
                cut, (at,) = left_truncate(ids, [p], max_len, keep_prefix)
            else:
                cut, (at,), (w,) = left_truncate_steps(ids, [p], [w], max_len, keep_prefix)
                written.append([w])
            seqs.append(cut)
            branches.append((len(cut), 0, 0))
            pos.append([at])
    return seqs, branches, pos, (written or None)


def pair_scores(model, batch, max_len: int, pad_id: int, keep_prefix: int = 0, encoding: str = "shared"):
    """([N] chosen, [N] rejected scores, tokens processed) of a batch of encoded pairs, in one forward pass.

    encoding "separate": two full sequences per pair, causal attention with no mask (prorag.prm.model.score_batch);
    "shared": pair_rows' rows with a branch mask (score_branched), the same scores up to float rounding
    (tests/services/trainer/test_prm_pairs.py). Training and the held-out accuracy both score through here.
    The mask's cost: SDPA given a mask computes the whole T x T square where the causal kernel skips the upper
    half, so attention grows with the joined length (about 1.3-1.5 times a pair's longer rendering); the linear
    layers, most of the compute at these lengths, see the prefix once."""
    rows = pair_rows(batch, max_len, keep_prefix, encoding) if encoding == "shared" else None
    if rows is None or all(len(p) == 1 for p in rows[2]):  # nothing joined: the unmasked causal kernel is cheaper
        seqs = [b[0] for b in batch] + [b[2] for b in batch]
        pos = [[b[1]] for b in batch] + [[b[3]] for b in batch]
        carried = [_written(b) for b in batch]
        written = None if carried and carried[0][0] is None else [[c] for c, _ in carried] + [[r] for _, r in carried]
        scored = score_batch(model, seqs, pos, max_len, pad_id, keep_prefix, written=written)
        scores = torch.stack([s[0] for s in scored])
        n = len(batch)
        return scores[:n], scores[n:], sum(min(len(s), max_len) for s in seqs)
    seqs, branches, pos, written = rows
    flat = [s for row in score_branched(model, seqs, branches, pos, pad_id, written=written) for s in row]
    scores = torch.stack(flat).reshape(len(batch), 2)  # each pair owns two scores, chosen first, in batch order
    return scores[:, 0], scores[:, 1], sum(len(s) for s in seqs)


def heldout_metrics(name: str, chosen: list[float], rejected: list[float], kinds: list[str]) -> dict[str, float]:
    """{name: pairwise accuracy, name.<kind>: the same per step kind} of held-out pairs' scores (chosen [N],
    rejected [N], kinds [N]): one kind's pairs can outnumber the rest, and the overall figure then hides another's."""
    out = {name: pairwise_accuracy(chosen, rejected)}
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        out[f"{name}.{kind}"] = pairwise_accuracy([chosen[i] for i in idx], [rejected[i] for i in idx])
    return out


def policy_likelihoods(model, pairs, max_len: int, pad_id: int, batch_size: int,
                       placement) -> tuple[list[float], list[float]]:
    """([N] chosen, [N] rejected) mean written-token log-probabilities of encoded pairs (encode_pairs' rows) under
    ``model``'s trunk read as its tied LM (prorag.prm.model.score_batch likelihood_only), without gradients."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    with torch.no_grad(), placement.autocast():
        for i in range(0, len(pairs), batch_size):
            part = pairs[i:i + batch_size]
            scored = score_batch(model, [p[0] for p in part] + [p[2] for p in part],
                                 [[p[1]] for p in part] + [[p[3]] for p in part], max_len, pad_id,
                                 written=[[p[4]] for p in part] + [[p[5]] for p in part], likelihood_only=True)
            chosen += [float(s[0]) for s in scored[:len(part)]]
            rejected += [float(s[0]) for s in scored[len(part):]]
    model.train(was_training)
    return chosen, rejected


def run_prm(ctx: JobContext) -> dict:
    cfg: PRMConfig = ctx.config
    cfg.apply_threads()
    placement = cfg.placement()
    pairs = load_pairs(cfg.pairs) + (load_pairs(cfg.extra_pairs) if cfg.extra_pairs else [])
    policy = resolve_model(cfg.world, cfg.policy_model, "policy_model")
    ctx.seed_everything(cfg.seed)
    if cfg.likelihood_weight and sharding_asked():
        # the readout multiplies by the whole embedding matrix outside the forward, where FSDP/ZeRO-3 hold a shard
        raise FailedPrecondition("likelihood_weight reads the trunk's embeddings outside its forward pass, which a "
                                 "sharded launch (FSDP or DeepSpeed) does not allow: launch with DDP (no accelerate "
                                 "config) or set likelihood_weight 0")
    model, tokenizer = prm_from_policy(policy, seed=cfg.seed, attn_implementation=placement.attn_implementation,
                                       likelihood_weight=cfg.likelihood_weight)
    model = prepare_for_training(model, placement, gradient_checkpointing=cfg.gradient_checkpointing)
    train = encode_pairs(tokenizer, [p for p in pairs if not _held_out(p.question_id, cfg.holdout)], cfg.label_source)
    held_pairs = [p for p in pairs if _held_out(p.question_id, cfg.holdout) and p.label(cfg.label_source) is not None]
    held = encode_pairs(tokenizer, held_pairs, cfg.label_source)
    if not train:
        raise FailedPrecondition(f"no {cfg.label_source}-labelled pairs to train on in "
                                 f"{' and '.join(p for p in (cfg.pairs, cfg.extra_pairs) if p)} "
                                 f"({len(pairs)} pairs read)")
    pad = tokenizer.pad_token_id
    # the branch mask needs an attention that takes a custom mask; flash_attention_2 takes none
    encoding = cfg.pair_encoding if attn_implementation(model) in BRANCH_ATTENTION else "separate"
    total, batch_at = accumulated_epochs(train, cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.seed)
    kinds = [p.meta.get("step_kind") or pair_kind(p.steps[0].kind, p.steps[1].kind) for p in held_pairs]
    # Before any training the trunk is the policy's: its own preference on the held-out pairs is the reference the
    # PRM's accuracy is read against (a PRM that does not beat it adds nothing the policy did not already prefer).
    # Read through the tied embeddings; a sharded launch holds only a shard of them.
    reference = {}
    if held and getattr(model.config, "tie_word_embeddings", False) and not sharding_asked():
        reference = heldout_metrics("heldout_policy_likelihood_accuracy",
                                    *policy_likelihoods(model, held, cfg.max_len, pad, cfg.batch_size, placement),
                                    kinds)

    def loss_fn(m, batch):
        chosen, rejected, tokens = pair_scores(m, batch, cfg.max_len, pad, encoding=encoding)
        loss = bradley_terry_loss(chosen, rejected)
        if cfg.verdict_weight:
            loss = loss + cfg.verdict_weight * verdict_loss(chosen, rejected)
        return loss, tokens

    result = run_loop(ctx, model, batch_at, loss_fn, cfg.loop_config(total, grad_accum=cfg.grad_accum),
                      placement=placement)
    if not result.completed:
        return {}
    model.eval()
    metrics = {"final_loss": result.loss, "train_pairs": len(train), "heldout_pairs": len(held),
               "shared_pairs": sum(len(r) == 2 for r in pair_rows(train, cfg.max_len, encoding=encoding)[2])}
    if held:
        # every process of a launch scores all of them: under FSDP each forward is a collective
        with torch.no_grad(), placement.autocast():
            c, r = [], []
            for i in range(0, len(held), cfg.batch_size):
                sc, sr, _ = call_in_engine(model, lambda m, part=held[i:i + cfg.batch_size]:
                                           pair_scores(m, part, cfg.max_len, pad, encoding=encoding))
                c += sc.tolist()
                r += sr.tolist()
        metrics.update(heldout_metrics("heldout_pairwise_accuracy", c, r, kinds))
        # the judge accepted every chosen step and rejected every other: how often a score's sign alone says so
        metrics["heldout_verdict_accuracy"] = (sum(x > 0 for x in c) + sum(x < 0 for x in r)) / (2 * len(c))
        metrics.update({f"heldout_pairs.{k}": kinds.count(k) for k in set(kinds)})
        metrics.update(reference)
    published = publish_trained(ctx, model, tokenizer, kind="prm", world=cfg.world, name=cfg.publish_name,
                                base=policy, stage="prm", metrics=metrics, step=total)
    if published is None:  # the other processes of a launch publish nothing
        return {}
    prms, ref = published
    ctx.emit(total, total, message=f"published {ref.key} at {prms.path(ref)}")
    return {**metrics, "steps": total, "prm": ref.key}


register_stage("prm", PRMConfig, run_prm, checks={"extra_pairs": "path"},
               description="process reward model: Bradley-Terry on labelled sibling pairs, scored at each step's "
                           "last token; published to the PRM registry")
