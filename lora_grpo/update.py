"""One optimizer update of the policy adapter on a Batch: accumulate → average → clip → step.

    micro-batches ─► forward (chunked log-probs, entropy) ─► grpo_loss × accumulation scale ─► backward
                  ─► average over processes (one flat all-reduce) ─► unscale ─► clip ─► optimizer + LR step,
                     or skip a NaN/inf update (stopping.count_nonfinite ends the run after too many)

A float16 model's loss is multiplied by its loss scale before backward and its gradients divided by it
before clipping (optim.LossScale); an update whose scaled gradients overflowed is skipped and halves
the scale, and is not counted as NaN/inf while the scale is above 1.

The loss is normalised by a token count fixed for the whole step, or weighted by each micro-batch's
share (the accumulation scale of the loss type's aggregation, loss.AGGREGATIONS), so the step's
gradient does not depend on how it was cut into micro-batches. The memory probe
(memory.plan_run_memory) runs `accumulate` and `forward` too: it measures this path, not a copy of it.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext

import torch

from .algo.logprobs import sequence_log_probs
from .algo.loss import (
    LOSS_TYPES,
    SEQUENCE_HIGH_CLIP,
    SEQUENCE_LOW_CLIP,
    LossSettings,
    clip_fraction_extremes,
    grpo_loss,
    padded_gather,
)
from .batch import Batch, MicroBatch
from .model.adapters import eval_mode, train_mode
from .optim import average_gradients, sum_over_processes
from .rng import shuffle_seed
from .run.failures import agreed_failures
from .run.stopping import count_nonfinite

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


class PolicyUpdate:
    """The parts an update touches (model, trainable params, optimizer, LR scheduler) and the loss
    settings, built once; `state` is the run's TrainState (non-finite count, reference_is_policy)."""

    def __init__(self, config, model, params, optimizer, scheduler, accelerator, state, event=None):
        self.config, self.model, self.params = config, model, params
        # event(name): the loop's named points around the optimizer's step (pre_optimizer_step, optimizer_step)
        self.event = event or (lambda name: None)
        self.optimizer, self.scheduler, self.accelerator, self.state = (
            optimizer,
            scheduler,
            accelerator,
            state,
        )
        # grpo_loss's settings (TRL 1.16's options under their names), built once
        self.settings = LossSettings.from_config(config)
        # The entropy quantile is over every process's tokens of the micro-batch (each process calls the gather).
        self.gather = padded_gather(accelerator) if accelerator.num_processes > 1 else None
        # Where a failure on one process is agreed on (run.failures.agreed_failures): before the gradients' average,
        # or, when each micro-batch gathers entropies (top_entropy_quantile < 1), before each micro-batch's gathers.
        self.agreed_per_micro_batch = self.gather is not None and config.top_entropy_quantile < 1
        # The entropy bonus needs the entropy's gradient; the adaptive coefficient may turn the bonus on later.
        self.entropy_grad = config.entropy_coef != 0 or config.use_adaptive_entropy
        # Optimizer / LR scheduler steps begun: from the first, the adapters and the optimizer may be
        # past the last finished step (what a failure can still save: failures.LastFinishedStep).
        self.optimizer_steps = 0

    def forward(self, mb: MicroBatch, return_entropy: bool = False, entropy_grad: bool = False):
        """(log-probs (B, T), entropy (B, T) or None) of a micro-batch under the active adapter."""
        extra = {"entropy_grad": True} if entropy_grad else {}
        return sequence_log_probs(
            self.model,
            mb.input_ids,
            mb.attention_mask,
            mb.completion_length,
            chunk_size=self.config.logprob_chunk_size,
            temperature=self.config.temperature,
            return_entropy=return_entropy,
            **extra,
        )

    @torch.no_grad()
    def log_probs(self, batch: Batch, micro_batch_size: int) -> Tensor:
        """(B, T) per-token log-probs under the active adapter, in eval mode (as sampled)."""
        with eval_mode(self.model):
            out = torch.zeros(
                batch.completion_mask.shape, dtype=torch.float32, device=batch.completion_mask.device
            )
            row = 0
            for mb in batch.micro_batches(micro_batch_size):
                logp, _ = self.forward(mb)
                out[row : row + logp.shape[0], : logp.shape[1]] = logp
                row += logp.shape[0]
            return out

    def __call__(self, batch: Batch, micro_batch_size: int) -> dict[str, float]:
        """One optimizer update on the batch. Returns the loss metrics (token-weighted means over the
        step), loss, grad_norm, lr, skipped_nonfinite."""
        cfg, acc = self.config, self.accelerator
        n_seq = batch.input_ids.shape[0]
        # Rows whose gradient is exactly zero are left out; the normalisers stay the whole step's.
        idle = zero_gradient_rows(batch.advantages, batch.completion_mask, cfg)
        if idle is None:
            idle = torch.zeros(n_seq, dtype=torch.bool, device=batch.advantages.device)
        # The step's token count (the denominator of the loss types normalised by it): the step's tokens
        # over every process, divided by the number of processes because their gradients are averaged;
        # with the rows left out, in one all-reduce.
        counts = sum_over_processes(
            {
                "tokens": batch.step_tokens(),
                "rows": float(n_seq),
                "idle": float(idle.sum()),
                "all_idle": float(bool(idle.all())),
            },
            acc,
        )
        num_tokens = counts["tokens"] / acc.num_processes
        if counts["idle"] == counts["rows"]:
            # No row of the step, on any process, has a gradient: no forward or backward at all, and
            # zero gradients, so the optimizer and the schedule step as after the full computation.
            for p in self.params:
                p.grad = torch.zeros_like(p)
            skipped = counts["rows"]
        else:
            if idle.all():
                # Another process trains: this one keeps a row, so that every process has the same
                # metrics to average (its gradient is zero, so the update is the same).
                idle[0] = False
            skipped = counts["idle"] - counts["all_idle"]
        trained = batch if not idle.any() else batch.rows((~idle).nonzero().flatten())
        n_micro = math.ceil(trained.input_ids.shape[0] / micro_batch_size)
        sums: dict[str, float] = {}
        per_sequence: dict[str, list[Tensor]] = {}
        # forwards and backwards that may run out of memory on one process, before the gradients' average
        with nullcontext() if self.agreed_per_micro_batch else agreed_failures(acc):
            with train_mode(self.model):  # checkpointing on; the model goes back to eval mode for sampling
                parts = [
                    self.accumulate(mb, num_tokens, n_seq, n_micro, read=False)
                    for mb in trained.micro_batches(micro_batch_size)
                ]
            for m, weight, loss in _read_once(parts):  # one device sync for every micro-batch's metrics
                for k in (SEQUENCE_LOW_CLIP, SEQUENCE_HIGH_CLIP):
                    if k in m:
                        per_sequence.setdefault(k, []).append(m.pop(k))
                for k, v in [*((k, v * weight) for k, v in m.items()), ("tokens", weight), ("loss", loss)]:
                    sums[k] = sums.get(k, 0.0) + v
        if sums:
            # The rows left out clip nothing (their advantage is 0): the clip fractions' token means are over every
            # completion's tokens, as TRL's, with theirs counted in.
            sums["idle_tokens"] = float(batch.completion_mask[idle].sum()) if idle.any() else 0.0
        if acc.num_processes > 1:
            average_gradients(self.params, acc)
            # Empty on every process alike when no process ran a forward.
            sums = sum_over_processes(sums, acc) if sums else sums
        extremes = {}
        if per_sequence:  # (on every process alike: none where no process ran a forward)
            low, high = (
                _whole_batch(per_sequence[k], idle, batch.completion_mask, cfg)
                for k in (SEQUENCE_LOW_CLIP, SEQUENCE_HIGH_CLIP)
            )
            group = cfg.clip_ratio_group_size or n_seq
            if group < n_seq:
                # TRL's micro-steps are random shares of the step's completions (it shuffles before cutting)
                order = torch.randperm(
                    n_seq,
                    generator=torch.Generator().manual_seed(shuffle_seed(cfg.seed, self.state.global_step)),
                ).to(low.device)
                low, high = low[order], high[order]
            gather = acc.gather if acc.num_processes > 1 else None
            extremes = clip_fraction_extremes(low, high, group, gather)
        control = self.state.adaptive_entropy
        if cfg.use_adaptive_entropy:  # one move of the coefficient per step, on every process's entropy
            control.step(reduce=(lambda t: acc.reduce(t, "sum")) if acc.num_processes > 1 else None)
        if cfg.use_adaptive_entropy or cfg.entropy_coef:
            # reported as TRL does (a token mean of a constant)
            sums["entropy_coef"] = control.coef * sums["tokens"]
        loss_total = sums.pop("loss", 0.0) / acc.num_processes
        idle_tokens = sums.pop("idle_tokens", 0.0)
        tokens = max(sums.pop("tokens", 0.0), 1.0)
        loss_scale = self.state.loss_scale
        scaled_by = loss_scale.value
        lr = self.scheduler.get_last_lr()[0]
        try:
            loss_scale.unscale(self.optimizer)  # after the average: every process finds the same overflow
            # clip_grad_norm_ also measures the norm; with no clipping (max_grad_norm 0) it scales by 1.
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm or math.inf))
            nonfinite = self._step_unless_nonfinite(loss_total, grad_norm, scaled_by)
        except Exception:
            loss_scale.forget_step()
            raise
        return {
            **{
                k: v / (tokens + idle_tokens if k.startswith("clip_ratio/") else tokens)
                for k, v in sums.items()
            },
            **extremes,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped_nonfinite": float(nonfinite),
            "zero_advantage_skipped": skipped / counts["rows"],
            **({"loss_scale": scaled_by} if loss_scale.enabled else {}),
        }

    def accumulate(
        self, mb: MicroBatch, num_tokens: float, n_seq: int, n_micro: int, read: bool = True
    ) -> tuple[dict[str, float], float, float]:
        """Forward, loss and backward of one micro-batch (gradients add up in .grad); returns
        (loss metrics, the micro-batch's loss tokens, its scaled loss) as floats, or as 0-d tensors
        with read=False (no device sync: the step reads every micro-batch's at once)."""
        cfg = self.config
        # the forward and the backward, each before a collective of every process when the micro-batch gathers
        agreed = (lambda: agreed_failures(self.accelerator)) if self.agreed_per_micro_batch else nullcontext
        with agreed():
            logp, entropy = self.forward(mb, return_entropy=True, entropy_grad=self.entropy_grad)
        ref = mb.ref_logp
        # the reference equals the policy this step (trainer.generation_round)
        if ref is None and cfg.beta != 0:
            ref = mb.old_logp if mb.old_logp is not None else logp.detach()
        control = self.state.adaptive_entropy
        coef = control.applied_coef if cfg.use_adaptive_entropy else cfg.entropy_coef
        # accumulation=: the returned loss is this micro-batch's share of the step (loss.AGGREGATIONS' scales).
        loss, m = grpo_loss(
            logp,
            mb.old_logp,
            ref,
            mb.advantages,
            mb.completion_mask,
            settings=self.settings,
            num_tokens=num_tokens,
            entropies=entropy,
            entropy_gather=self.gather,
            entropy_coef=coef,
            entropy_bonus=cfg.use_adaptive_entropy or cfg.entropy_coef != 0,
            accumulation=(mb.rows, n_seq, n_micro),
            tensor_metrics=True,
        )
        with agreed():
            self.state.loss_scale.scale(
                loss
            ).backward()  # × the loss scale in float16 (else × 1: loss itself)
        if cfg.use_adaptive_entropy:
            control.accumulate(entropy, mb.completion_mask, cfg.top_entropy_quantile, self.gather)
        m["entropy_sum"] = (entropy.detach() * mb.completion_mask).sum()
        part = (m, mb.completion_mask.sum(), loss.detach())
        return _read_once([part])[0] if read else part

    def _step_unless_nonfinite(self, loss: float, grad_norm: float, scaled_by: float) -> bool:
        """Step the optimizer, or skip a NaN/inf update (every process decides alike: the values are
        already averaged); too many skips in a row end the run. An overflow of float16's scaled
        gradients (the loss finite, the scale `scaled_by` above 1) is skipped too, halves the scale and
        is not counted. Returns whether it skipped."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.optimizer_steps += 1
        self.event("pre_optimizer_step")  # the gradients averaged, unscaled and clipped
        if finite:
            self.optimizer.step()
            self.state.reference_is_policy = False
        self.event("optimizer_step")
        self.scheduler.step()  # the schedule follows the step count, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        loss_scale = self.state.loss_scale
        loss_scale.update()  # halves after an overflow, else counts towards doubling
        if not finite and math.isfinite(loss) and scaled_by > 1:  # (a scale that is off is 1)
            logger.info(
                "step %d: float16 gradients overflowed at loss scale %g: update skipped, the scale is now %g",
                self.state.global_step + 1,
                scaled_by,
                loss_scale.value,
            )
            return True
        if not finite:
            logger.warning(
                "step %d: loss %s, grad norm %s: update skipped (%d in a row)",
                self.state.global_step + 1,
                loss,
                grad_norm,
                self.state.nonfinite_in_a_row + 1,
            )
        count_nonfinite(self.state, finite, self.config)
        return not finite


def zero_gradient_rows(advantages: Tensor, completion_mask: Tensor, config) -> Tensor | None:
    """(B,) bool: the rows that contribute exactly zero to this update's gradient, or None when the
    loss settings give every row one. A row with zero advantage (a group of equal rewards, or a
    completion at its group's mean) or without loss tokens has a policy term of exactly 0 in every
    loss type; what else could act on it is off: beta = 0 (no KL term), no entropy bonus (fixed or
    adaptive), top_entropy_quantile = 1 (the quantile would read its tokens' entropies). A loss type
    normalised per micro-batch (loss_types.LossType.per_micro_batch) is left whole: its token mean
    depends on which rows share a micro-batch. The others are normalised by the whole step's tokens
    or sequences (the accumulation scale's share of the step's sequences), so leaving rows out
    changes nothing. Every row may be idle: the update then runs no forward at all."""
    if (
        config.beta != 0
        or config.entropy_coef != 0
        or config.use_adaptive_entropy
        or config.top_entropy_quantile < 1
        or not LOSS_TYPES[config.loss_type].zero_advantage_rows_skippable
    ):
        return None
    return (advantages == 0) | (completion_mask.sum(dim=1) == 0)


def _whole_batch(parts: list[Tensor], idle: Tensor | None, completion_mask: Tensor, config) -> Tensor:
    """(B,) per-sequence clip fractions of the whole step's batch, in its row order, from the trained
    rows' micro-batches (parts, in order): a row left out of the update (zero advantage, so nothing of
    it clips) has 0, or NaN when it has no loss tokens at importance_sampling "token" (TRL's
    masked_seq_mean: 0 / 0), as if it had been trained on."""
    trained = torch.cat(parts).to(completion_mask.device, torch.float32)
    if idle is None or not idle.any():
        return trained
    whole = torch.zeros(idle.shape[0], dtype=torch.float32, device=completion_mask.device)
    if config.importance_sampling == "token":
        whole[completion_mask.sum(dim=1) == 0] = math.nan
    whole[~idle] = trained
    return whole


def _read_once(
    parts: list[tuple[dict[str, Tensor], Tensor, Tensor]],
) -> list[tuple[dict[str, float], float, float]]:
    """Micro-batches' (metrics, tokens, loss) 0-d tensors -> Python floats, in one transfer; each value
    is the float .item() would give; (B,) metrics stay tensors (detached, on their device). The
    entropy is a token mean of the micro-batch, as before."""
    flat = [
        t.detach().double()
        for m, weight, loss in parts
        for t in (*(v for v in m.values() if v.dim() == 0), weight, loss)
    ]
    values = iter(torch.stack(flat).tolist() if flat else [])
    out = []
    for m, _, _ in parts:
        read = {k: next(values) if v.dim() == 0 else v.detach() for k, v in m.items()}
        weight, loss = next(values), next(values)
        read["entropy"] = read.pop("entropy_sum") / max(weight, 1.0)
        out.append((read, weight, loss))
    return out
