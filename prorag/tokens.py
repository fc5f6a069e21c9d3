"""Token-level trajectories: the one token-sequence type of SFT data and rollouts.

A trajectory's tokens are its prompt, then per step the tokens the policy generated and the
tokens the environment inserted after them (the retrieval block or glue,
:func:`prorag.trajectory.glue_after`). SFT encoding (:func:`prorag.data.sft.encode_segments`)
and the rollout loop (:func:`prorag.rollout.run_rollouts`) build it step by step the same way,
so each step's token span is recorded as it is appended: a process reward or a per-step
advantage indexes tokens directly and never re-encodes step text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class StepSpan:
    """Token positions of one step: ``[start, generated_end)`` the policy generated,
    ``[generated_end, end)`` the environment inserted after it (empty after an invalid step,
    or when the context ran out before the insertion fitted)."""

    start: int
    generated_end: int
    end: int

    @property
    def generated(self) -> slice:
        return slice(self.start, self.generated_end)

    @property
    def inserted(self) -> slice:
        return slice(self.generated_end, self.end)


@dataclass
class TokenTrajectory:
    """One token sequence, prompt included; the four per-token lists are aligned, each [T].

    token_ids [T]: ids as produced (generated ids are never re-encoded);
    generated_mask [T]: 1 = produced by the policy and trained on; 0 = prompt, documents, glue;
    weights [T]: per-token CE weights of the format-aware loss on generated tokens
      (:func:`prorag.trajectory.format_loss_weights`), 0.0 where the mask is 0;
    logprobs [T]: sampling log-probs of generated tokens; 0.0 elsewhere, or when unknown (SFT data);
    prompt_length: tokens ``[0, prompt_length)`` are the prompt;
    spans [S]: one per step, in order; they tile ``[prompt_length, T)``.
    """

    token_ids: list[int] = field(default_factory=list)
    generated_mask: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    spans: list[StepSpan] = field(default_factory=list)

    @classmethod
    def from_prompt(cls, prompt_ids: Sequence[int]) -> "TokenTrajectory":
        """A trajectory holding only its prompt [P] (not generated, weight 0, log-prob 0)."""
        n = len(prompt_ids)
        return cls(list(prompt_ids), [0] * n, [0.0] * n, [0.0] * n, prompt_length=n)

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict:
        """Plain lists and numbers only, so a saved trajectory loads without unpickling code."""
        return {"token_ids": self.token_ids, "generated_mask": self.generated_mask, "weights": self.weights,
                "logprobs": self.logprobs, "prompt_length": self.prompt_length,
                "spans": [[s.start, s.generated_end, s.end] for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenTrajectory":
        return cls(list(d["token_ids"]), list(d["generated_mask"]), list(d["weights"]), list(d["logprobs"]),
                   int(d["prompt_length"]), [StepSpan(*s) for s in d["spans"]])

    @property
    def generated_tokens(self) -> int:
        return sum(self.generated_mask)

    def add_step(self, ids: Sequence[int], weights: Sequence[float], logprobs: Sequence[float] | None = None) -> None:
        """Append the next step's generated tokens, opening its span.

        ids [n]; weights [n]; logprobs [n], or None when unknown (recorded as 0.0).
        """
        n = len(ids)
        if len(weights) != n or (logprobs is not None and len(logprobs) != n):
            raise ValueError(f"a step of {n} tokens needs {n} weights and log-probs, got {len(weights)} and "
                             f"{'none' if logprobs is None else len(logprobs)}")
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.generated_mask.extend([1] * n)
        self.weights.extend(float(w) for w in weights)
        self.logprobs.extend([0.0] * n if logprobs is None else (float(lp) for lp in logprobs))
        self.spans.append(StepSpan(start, start + n, start + n))

    def add_inserted(self, ids: Sequence[int]) -> None:
        """Append tokens the environment inserts after the last step [n]; they extend its span."""
        if not self.spans:
            raise ValueError("inserted tokens follow a step; the prompt goes to TokenTrajectory.from_prompt")
        n = len(ids)
        self.token_ids.extend(ids)
        self.generated_mask.extend([0] * n)
        self.weights.extend([0.0] * n)
        self.logprobs.extend([0.0] * n)
        last = self.spans[-1]
        self.spans[-1] = StepSpan(last.start, last.generated_end, len(self.token_ids))


__all__ = ["StepSpan", "TokenTrajectory"]
