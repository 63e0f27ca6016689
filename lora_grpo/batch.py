"""The training batch: a rollout made ready for the loss, cut into optimizer steps and micro-batches.

Rollout ─► Batch.from_rollout (loss mask, advantages) ─► steps (one per optimizer step)
        ─► micro_batches(size): MicroBatch records, what the loss path takes (memory.probe's
           worst_case_micro_batch builds one for the start-up probe)

A rollout's optimizer steps not trained yet are `RolloutSteps`: the loop trains them one by one, and
a checkpoint written between two of them saves them (CPU tensors), so that a resume trains the rest
on the same rollout, as the uninterrupted run does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

Tensor = torch.Tensor


def loss_mask(rollout, mask_truncated_completions: bool) -> Tensor:
    """(B, T) 1 on the completion tokens that count in the loss: the completion up to and including
    its EOS, but not the tokens tool replies put in it (a rollout's ``tool_mask``: context the
    policy reads, not actions it took); a truncated completion entirely 0 with
    mask_truncated_completions. The one place a rollout's loss mask comes from (tokens the policy
    did not choose get 0 here), so the loss, the KL, the entropy and the clip metrics all skip them.
    With tools the mask can have holes: 1s after 0s."""
    mask = rollout.completion_mask.clone()
    tool_mask = getattr(rollout, "tool_mask", None)
    if tool_mask is not None:
        mask = mask * tool_mask.to(mask.dtype)
    if mask_truncated_completions:
        mask[rollout.truncated] = 0
    return mask


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's share of a Batch, trimmed to the columns it uses. A log-prob forward
    reads the first three; the loss reads the rest (eval/kl_to_base's forwards leave them None)."""

    input_ids: Tensor  # (m, P'+T') left-padded prompt, right-padded completion
    attention_mask: Tensor  # (m, P'+T')
    completion_length: int  # T': the completion columns at the end of input_ids
    completion_mask: Tensor | None = None  # (m, T') 1 on completion tokens that count in the loss
    advantages: Tensor | None = None  # (m,)
    old_logp: Tensor | None = None  # (m, T'), only when the batch is trained on more than once
    ref_logp: Tensor | None = None  # (m, T'), None: the reference equals the policy this step

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Batch:
    """One generation batch, ready for the loss. B = prompts × G sequences."""

    input_ids: Tensor  # (B, P+T) left-padded prompt, right-padded completion
    attention_mask: Tensor  # (B, P+T)
    completion_mask: Tensor  # (B, T) 1 on completion tokens that count in the loss
    advantages: Tensor  # (B,)
    old_logp: Tensor | None = None  # (B, T), only when the batch is trained on more than once
    ref_logp: Tensor | None = None  # (B, T), only when beta > 0 and the slot differs from the policy
    # (B,), only when the generation feeds several optimizer steps (steps): each row's share of the generation's
    # loss tokens per step, so that a step's rows sum to the generation's tokens / steps, the token count the
    # loss types normalised by the step's tokens divide by (as TRL's num_items_in_batch, whatever its slice holds)
    token_share: Tensor | None = None

    @classmethod
    def from_rollout(cls, rollout, advantages: Tensor, *, mask_truncated_completions: bool) -> Batch:
        mask = loss_mask(rollout, mask_truncated_completions)
        return cls(rollout.input_ids, rollout.attention_mask, mask, advantages.to(mask.device))

    def to(self, device) -> Batch:
        return Batch(
            **{f.name: None if (v := getattr(self, f.name)) is None else v.to(device) for f in fields(self)}
        )

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def steps(self, num_steps: int = 1) -> list[Batch]:
        """The optimizer steps this generation batch feeds: `num_steps` equal slices of its rows, in
        order (one slice, itself, for num_steps = 1), each normalised by the generation's tokens per step."""
        n = self.input_ids.shape[0]
        if num_steps == 1:
            return [self]
        if n % num_steps:
            raise ValueError(
                f"a generation batch of {n} sequences cannot be cut into {num_steps} equal steps"
            )
        share = self.completion_mask.sum().to(torch.float32) / n
        whole = replace(self, token_share=share.expand(n).clone())
        size = n // num_steps
        return [whole.rows(slice(i, i + size)) for i in range(0, n, size)]

    def step_tokens(self) -> float:
        """The token count of this optimizer step's loss normaliser (before the average over processes):
        its own loss tokens, or with several steps to a generation the generation's per step."""
        return float(self.completion_mask.sum() if self.token_share is None else self.token_share.sum())

    def rows(self, rows: slice | Tensor) -> Batch:
        return Batch(
            **{f.name: None if (v := getattr(self, f.name)) is None else v[rows] for f in fields(self)}
        )

    def micro_batches(self, size: int) -> Iterator[MicroBatch]:
        """Slices of `size` sequences, each trimmed to the columns it really uses."""
        P = self.input_ids.shape[1] - self.completion_length
        # each row's first real prompt column and last loss column (a tool reply's 0s can sit before it), read
        # to the host at once: a read per micro-batch would wait for the device between its backward and the next
        prompt, loss = self.attention_mask[:, :P] > 0, self.completion_mask > 0
        firsts = torch.where(prompt.any(1), prompt.int().argmax(1), P)
        lasts = torch.where(loss.any(1), loss.shape[1] - 1 - loss.flip(1).int().argmax(1), -1)
        firsts, lasts = torch.stack([firsts, lasts]).tolist()
        for start in range(0, self.input_ids.shape[0], size):
            rows = slice(start, start + size)
            mask = self.attention_mask[rows]
            first = min(firsts[rows]) % max(P, 1)  # drop all-pad prompt columns (none at all: P, read as 0)
            t = max(max(lasts[rows]) + 1, 1)  # drop the columns after the last loss token
            cols = slice(first, P + t)
            yield MicroBatch(
                input_ids=self.input_ids[rows, cols],
                attention_mask=mask[:, cols],
                completion_length=t,
                completion_mask=self.completion_mask[rows, :t],
                advantages=self.advantages[rows],
                old_logp=None if self.old_logp is None else self.old_logp[rows, :t],
                ref_logp=None if self.ref_logp is None else self.ref_logp[rows, :t],
            )


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step as the loop walks them (trainer._step_batches): its batch, the metrics of
    the rollout it is the first step of ({} for a rollout's later steps), the epoch its prompts came
    from, and whether it ends that epoch (the last step of the rollout whose prompts ended it)."""

    batch: Batch
    metrics: dict[str, float]
    epoch: int
    ends_epoch: bool


@dataclass(frozen=True)
class RolloutSteps:
    """A rollout's optimizer steps not trained yet, in training order, with what their step ends
    need: the epoch the prompts came from and whether drawing them ended an epoch (its last step ends
    the epoch). Immutable: `pop()` returns the next step and a new RolloutSteps of the rest, so that a
    reference kept for a failure (failures.LastFinishedStep) still holds the step that failed."""

    steps: tuple[Batch, ...]
    epoch: int
    epoch_ended: bool

    def __len__(self) -> int:
        return len(self.steps)

    def pop(self) -> tuple[Batch, RolloutSteps]:
        return self.steps[0], RolloutSteps(self.steps[1:], self.epoch, self.epoch_ended)

    def state_dict(self) -> dict[str, Any]:
        """Plain values and CPU tensors (each its own copy: a slice saved alone would carry its
        whole rollout's storage), so that torch.load(weights_only=True) reads it back."""
        return {
            "epoch": self.epoch,
            "epoch_ended": self.epoch_ended,
            "steps": [
                {
                    f.name: None if (v := getattr(b, f.name)) is None else v.to("cpu", copy=True)
                    for f in fields(b)
                }
                for b in self.steps
            ],
        }

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any], device) -> RolloutSteps:
        steps = tuple(Batch(**step).to(device) for step in saved["steps"])
        return cls(steps, int(saved["epoch"]), bool(saved["epoch_ended"]))
