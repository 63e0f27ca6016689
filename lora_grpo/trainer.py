"""GRPOTrainer: the loop. It orchestrates the stages; the math lives in the pure modules.

One optimizer step:

    prompts ─► rollout (policy adapter, no grad) ─► rewards ─► advantages
            ─► old log-probs (only if num_iterations > 1) ─► reference log-probs (reference adapter; skipped if beta = 0)
            ─► num_iterations × [micro-batched loss + backward, clip, optimizer + LR step]
            ─► maybe sync the reference slot ─► metrics, checkpoint

Simplifications, on purpose: generation runs with the training model (no vLLM); the batch of one
step is generated once and reused num_iterations times; gradients of several processes are
averaged explicitly after accumulation (each process holds its own base and both adapters, and a
prompt's whole group stays on one process).
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import checkpoint as ckpt
from .adapters import POLICY, base_forward, policy_parameters, reference_forward
from .advantages import group_advantages, zero_std_fraction
from .config import ConfigError, GRPOConfig
from .data import PROMPT_MESSAGES, PromptBatches, resolve_dataset
from .evaluation import chunk_generator, count_correct, eval_chunks, eval_metrics, num_eval_samples, prompt_results
from .logprobs import check_log_probs, sequence_log_probs
from .loss import accumulation_scale, grpo_loss, k3_kl
from .memory import (
    MiB,
    MemoryPlan,
    available_bytes,
    longest_prompt,
    optimizer_state_bytes,
    plan_memory,
    rollout_bytes,
    worst_case_micro_batch,
)
from .model import keep_4bit_weights_fixed, load_model, set_gradient_checkpointing
from .optim import apply_config as apply_optimizer_config
from .optim import WarmupRestarts, average_gradients, build_optimizer, build_scheduler, reset_optimizer_state
from .reference import SyncSchedule, sync_reference
from .reporting import RunReporter, accelerator_kwargs
from .rewards import (
    TrainerState,
    check_reward_columns,
    check_reward_weights,
    compute_rewards,
    conversational_inputs,
    resolve_reward_funcs,
    reward_metrics,
    reward_names,
)
from .rollout import (
    Rollout,
    _tokenize_left_padded,
    check_context,
    check_prompts_fit,
    check_special_tokens,
    generate_rollout,
)
from .stopping import NonFiniteError, StopSignals, TrainingInterrupted, agreed_signal

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


@dataclass
class Batch:
    """One generation batch, ready for the loss. B = prompts × G sequences."""

    input_ids: Tensor  # (B, P+T) left-padded prompt, right-padded completion
    attention_mask: Tensor  # (B, P+T)
    completion_mask: Tensor  # (B, T) 1 on completion tokens that count in the loss
    advantages: Tensor  # (B,)
    old_logp: Tensor | None = None  # (B, T), only when num_iterations > 1
    ref_logp: Tensor | None = None  # (B, T), only when beta > 0

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def micro_batches(self, size: int):
        """Slices of `size` sequences, each trimmed to the columns it really uses."""
        P = self.input_ids.shape[1] - self.completion_length
        for start in range(0, self.input_ids.shape[0], size):
            rows = slice(start, start + size)
            mask = self.attention_mask[rows]
            first = int((mask[:, :P].sum(0) > 0).int().argmax()) if P else 0  # drop all-pad prompt columns
            t = max(1, int(self.completion_mask[rows].sum(1).max()))  # drop all-pad completion columns
            cols = slice(first, P + t)
            yield {
                "input_ids": self.input_ids[rows, cols],
                "attention_mask": mask[:, cols],
                "completion_mask": self.completion_mask[rows, :t],
                "advantages": self.advantages[rows],
                "old_logp": None if self.old_logp is None else self.old_logp[rows, :t],
                "ref_logp": None if self.ref_logp is None else self.ref_logp[rows, :t],
                "completion_length": t,
            }


class GRPOTrainer:
    """GRPO with a LoRA policy and a reference slot on one (optionally 4-bit) base.

    >>> trainer = GRPOTrainer(config, reward_funcs=[correctness], train_dataset=ds)   # doctest: +SKIP
    >>> trainer.train()                                                               # doctest: +SKIP

    `trainer.model` is the peft model with the adapters "policy" and "reference" (and "base", a
    frozen copy of init_adapter, in a warm-started run: what eval/kl_to_base measures from);
    `trainer.sync_reference()` syncs the reference slot now and returns the sync's metrics.
    """

    def __init__(
        self,
        config: GRPOConfig,
        reward_funcs: Sequence[Callable | str] | Callable | str | None = None,
        train_dataset=None,
        eval_dataset=None,
        *,
        model=None,
        tokenizer=None,
    ):
        from accelerate import Accelerator

        self._created = time.perf_counter()
        self.config = config
        # report_to's trackers; a missing tracker package fails here, before the model loads
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), **accelerator_kwargs(config))
        # Reward functions first: a wrong one fails before the model loads.
        specs = reward_funcs if reward_funcs is not None else config.reward_funcs
        self.reward_funcs = resolve_reward_funcs(specs, context={"max_completion_length": config.max_completion_length})
        if not self.reward_funcs:
            raise ValueError("no reward functions: pass reward_funcs=[...] or set reward_funcs in the config")
        check_reward_weights(config.reward_weights, len(self.reward_funcs))

        # The same seed on every process: the adapters must start identical (sampling has its own
        # per-process generator below).
        self._seed_everything(config.seed)
        if model is None:
            device_map = {"": self.accelerator.device} if self.accelerator.device.type == "cuda" else None
            model, tokenizer = load_model(config, device_map=device_map)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self.model, self.tokenizer = model, tokenizer
        keep_4bit_weights_fixed(model)  # also for a model the caller built (see model.py)
        check_context(config.max_prompt_length, config.max_completion_length, model)
        if next(model.parameters()).device != self.accelerator.device and not getattr(model, "is_loaded_in_4bit", False):
            self.model.to(self.accelerator.device)

        train_source = train_dataset if train_dataset is not None else config.dataset
        if train_source is None:
            raise ValueError("no training prompts: pass train_dataset=... or set `dataset` in the config")
        self.train_dataset = resolve_dataset(train_source, config, tokenizer, "train")
        eval_source = eval_dataset if eval_dataset is not None else config.eval_dataset
        self.eval_dataset = resolve_dataset(eval_source, config, tokenizer, "eval")
        if self.eval_dataset is not None and config.eval_limit:
            self.eval_dataset = self.eval_dataset.select(range(min(config.eval_limit, len(self.eval_dataset))))
        # Columns reach the reward functions as keywords (all but the rendered prompt and the chat
        # messages, which arrive as `prompts`; see rewards()): check before any work.
        for name, ds in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            if ds is not None:
                columns = [c for c in ds.column_names if c not in ("prompt", PROMPT_MESSAGES)]
                check_reward_columns(self.reward_funcs, columns, name)
                if config.max_prompt_length is None:
                    check_prompts_fit(tokenizer, list(ds["prompt"]), config.max_completion_length, model)
        if self.accelerator.num_processes > 1:
            # Each process samples its own prompts. Equal shards keep every process at the same step
            # count and epoch boundaries (so collectives match and epoch syncs happen together).
            world = self.accelerator.num_processes
            usable = len(self.train_dataset) - len(self.train_dataset) % world
            self.train_dataset = self.train_dataset.select(range(usable)).shard(world, self.accelerator.process_index)

        self.batches = PromptBatches(self.train_dataset, config.prompts_per_step, seed=config.seed)
        self.total_steps = config.max_steps or config.num_epochs * self.batches.steps_per_epoch
        self.params = policy_parameters(self.model)
        self.optimizer = build_optimizer(self.params, config)
        self.loss_settings = dict(  # grpo_loss's settings, built once
            loss_type=config.loss_type, epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
            beta=config.beta, max_completion_length=config.max_completion_length,
            importance_sampling=config.importance_sampling, kl_ratio_correction=config.kl_ratio_correction,
        )
        # ref_sync_restart_warmup: the warmup restarts at each sync (its state goes into checkpoints)
        self.warmup_restarts = (WarmupRestarts(config.warmup_steps * config.num_iterations)
                                if config.ref_sync_restart_warmup else None)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps, self.warmup_restarts)
        self.sync_schedule = SyncSchedule.from_config(config)
        if config.ref_sync_on_plateau and self.eval_dataset is None:
            raise ConfigError("ref_sync_on_plateau=true watches the eval score, but there are no eval prompts: set "
                              "eval_dataset (or pass eval_dataset=...), or turn it off")
        self.generator = torch.Generator(device=self.accelerator.device).manual_seed(
            config.seed + 1000 * self.accelerator.process_index
        )
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.nonfinite_in_a_row = 0
        self.reference_is_policy = True  # the initial reference is an exact copy of the initial policy
        check_special_tokens(self.model, self.tokenizer)
        self.log_prob_check = self._check_log_probs()
        self.output_dir = Path(config.output_dir)
        self.is_main = self.accelerator.is_main_process
        self.reporter = RunReporter(config, self.accelerator, reward_names(self.reward_funcs), self.total_steps)
        self._last_samples = None  # the last step's samples for completions.jsonl (set by advantages())
        # micro_batch_size / gradient_checkpointing 'auto', and the memory preflight: before any rollout.
        self.memory_plan = self._plan_memory()
        plan = self.memory_plan
        self.micro_batch_size = config.micro_batch_size if plan is None else plan.micro_batch_size
        self.gradient_checkpointing = config.gradient_checkpointing if plan is None else plan.gradient_checkpointing

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to total_steps; returns the run summary (also written to summary.json)."""
        cfg = self.config
        start = time.perf_counter()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.to_yaml(self.output_dir / "config.yaml")
        if cfg.resume_from_checkpoint:
            self.load_checkpoint(cfg.resume_from_checkpoint)
        self.reporter.start(self.step, resumed=bool(cfg.resume_from_checkpoint))  # logs truncated or fresh; trackers
        if self.memory_plan is not None:  # what 'auto' chose (the probe ran in __init__, before any rollout)
            self._print(self.memory_plan.describe(cfg.micro_batch_size == "auto", cfg.gradient_checkpointing == "auto"))
        eval_before = self.evaluate() if self.eval_dataset is not None and self.step == 0 else {}
        if eval_before:
            self._report_eval("before", eval_before)
            self._observe_eval(eval_before)
        # Stop signals are deferred until the end of the run, final eval and saves included.
        with StopSignals() as stop:
            with self.reporter.progress(self.step):
                while self.step < self.total_steps:
                    epoch, rows = next(self.batches)
                    epoch_ended = self.batches.epoch != epoch
                    metrics = self.training_step(rows)
                    self.step += 1
                    metrics["epoch"] = epoch
                    # Eval before the sync decision, so that the plateau trigger reads this step's eval.
                    # For every other trigger the order is free: eval reads only the policy and the
                    # start (base_forward), a sync writes only the reference slot and the optimizer.
                    if self.eval_dataset is not None and cfg.eval_steps and self.step % cfg.eval_steps == 0 and self.step < self.total_steps:
                        evaluated = self.evaluate()
                        metrics.update(evaluated)
                        self._observe_eval(evaluated)
                    reason = self.sync_schedule.due(self.step, epoch_ended=epoch_ended, kl=metrics.get("kl"))
                    if reason:
                        metrics.update(self.sync_reference())
                        metrics["sync/event"] = 1.0
                        metrics["sync/reason"] = reason
                    self.history.append(metrics)
                    self.reporter.log_step(self.step, metrics, self._last_samples)  # metrics, completions, trackers, bar
                    if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                        self._print(self._progress_line(metrics))
                    signum = agreed_signal(stop.received, self.accelerator.num_processes, self.accelerator.device)
                    if signum:
                        self._stop(signum)
                    if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                        self.save_checkpoint()
            eval_after = self.evaluate() if self.eval_dataset is not None else {}
            if eval_after:
                self._report_eval("after", eval_after)
            self.save_checkpoint()
            if self.is_main:
                self._write("the final adapter", lambda: ckpt.save_adapter(self.model, self.output_dir / "adapter", POLICY))
        summary = self._summary(eval_before, eval_after, time.perf_counter() - start)
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.reporter.finish()
        return summary

    def training_step(self, rows: dict[str, list]) -> dict[str, float]:
        """One optimizer step (num_iterations passes) on one batch of prompts; returns flat metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        rollout = self.generate(rows["prompt"])
        t_gen = time.perf_counter()
        advantages, metrics = self.advantages(rollout, rows)
        mask = rollout.completion_mask.clone()
        if cfg.mask_truncated_completions:
            mask[rollout.truncated] = 0
        batch = Batch(rollout.input_ids, rollout.attention_mask, mask, advantages.to(mask.device))
        if cfg.num_iterations > 1:
            batch.old_logp = self.log_probs(batch)
        # A reference slot that provably equals the policy (a fresh or warm-started run before its
        # first update, right after a hard sync) costs no forward: optimize() uses the policy's own.
        if cfg.beta != 0 and not self.reference_is_policy:
            with reference_forward(self.model):
                batch.ref_logp = self.log_probs(batch)
        metrics["reference_reused_policy"] = float(cfg.beta != 0 and self.reference_is_policy)
        t_ref = time.perf_counter()
        skipped = 0.0
        for _ in range(cfg.num_iterations):
            metrics.update(self.optimize(batch))
            skipped += metrics["skipped_nonfinite"]
        metrics["skipped_nonfinite"] = skipped  # of this step's num_iterations updates
        t_end = time.perf_counter()
        tokens = int(rollout.completion_mask.sum())
        metrics.update({
            "time/rollout": t_gen - t0,
            "time/log_probs": t_ref - t_gen,
            "time/train": t_end - t_ref,
            "time/step": t_end - t0,
            "tokens_per_second": tokens / (t_end - t0),
        })
        return metrics

    # ------------------------------------------------------------------ stages
    def generate(self, prompts: list[str], num_generations: int | None = None, temperature: float | None = None,
                 generator: torch.Generator | None = None) -> Rollout:
        """Sample with the policy; `generator` defaults to the training sampling stream."""
        cfg = self.config
        return generate_rollout(
            self.model,
            self.tokenizer,
            prompts,
            num_generations=num_generations or cfg.num_generations,
            max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty,
            generator=self.generator if generator is None else generator,
            decode_mode=cfg.decode_mode,
        )

    def rewards(self, rollout: Rollout, rows: dict[str, list], group_size: int):
        """Rewards (B,), per-function (B, F), metrics. Every reward function gets TRL's keywords
        (rewards.py): dataset columns repeated for each group member; a row whose prompt was chat
        messages gets them as its prompt and [{"role": "assistant", "content": text}] as its
        completion; completion_ids, completion_lengths, truncated, trainer_state."""
        columns = {k: [v for v in values for _ in range(group_size)] for k, values in rows.items() if k != "prompt"}
        prompts, completions = conversational_inputs(
            rollout.prompts, rollout.completions, columns.pop(PROMPT_MESSAGES, None)
        )
        ids, mask = rollout.completion_ids.cpu(), rollout.completion_mask.cpu().bool()
        columns["completion_ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]  # up to and including EOS
        columns["completion_lengths"] = rollout.completion_lengths.tolist()
        columns["truncated"] = rollout.truncated.tolist()
        columns["trainer_state"] = TrainerState(
            global_step=self.step, max_steps=self.total_steps, epoch=self.step / self.batches.steps_per_epoch
        )
        return compute_rewards(self.reward_funcs, prompts, completions, columns, weights=self.config.reward_weights)

    def advantages(self, rollout: Rollout, rows: dict[str, list]) -> tuple[Tensor, dict[str, float]]:
        """Rewards → group-relative advantages (B,), with the step's reward and completion metrics."""
        cfg = self.config
        rewards, per_func, metrics = self.rewards(rollout, rows, cfg.num_generations)
        advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        self._last_samples = (rollout.prompts, rollout.completions, per_func, rewards, advantages)  # for log_completions
        lengths = rollout.completion_lengths.float()
        truncated = rollout.truncated.float()
        if self.accelerator.num_processes > 1:  # metrics over every process's groups, not just this one's
            rewards, per_func, lengths, truncated = (
                self.accelerator.gather(t.to(self.accelerator.device)).cpu()
                for t in (rewards, per_func, lengths, truncated)
            )
            metrics = reward_metrics(rewards, per_func, reward_names(self.reward_funcs))
        metrics.update({
            "frac_reward_zero_std": zero_std_fraction(rewards, cfg.num_generations),
            "completion_length/mean": lengths.mean().item(),
            "completion_length/max": lengths.max().item(),
            "truncated_fraction": truncated.mean().item(),
        })
        return advantages, metrics

    def _forward_log_probs(self, mb: dict[str, Any], return_entropy: bool = False):
        return sequence_log_probs(
            self.model,
            mb["input_ids"],
            mb["attention_mask"],
            mb["completion_length"],
            chunk_size=self.config.logprob_chunk_size,
            temperature=self.config.temperature,
            return_entropy=return_entropy,
        )

    @torch.no_grad()
    def log_probs(self, batch: Batch) -> Tensor:
        """(B, T) per-token log-probs under the active adapter, in eval mode (as sampled)."""
        was_training = self.model.training
        self.model.eval()
        try:
            out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.completion_mask.device)
            row = 0
            for mb in batch.micro_batches(self.micro_batch_size):
                logp, _ = self._forward_log_probs(mb)
                out[row : row + logp.shape[0], : logp.shape[1]] = logp
                row += logp.shape[0]
            return out
        finally:
            self.model.train(was_training)

    def optimize(self, batch: Batch) -> dict[str, float]:
        """One optimizer update on the batch: accumulate → average → clip → step.
        Returns the loss metrics (token-weighted means over the step), loss, grad_norm, lr."""
        cfg, acc = self.config, self.accelerator
        self.model.train()
        n_seq = batch.input_ids.shape[0]
        n_micro = math.ceil(n_seq / self.micro_batch_size)
        # dapo's denominator: the step's tokens over every process, divided by the number of
        # processes because their gradients are averaged.
        num_tokens = self._sum_over_processes({"t": batch.completion_mask.sum().item()})["t"] / acc.num_processes
        sums: dict[str, float] = {}
        for mb in batch.micro_batches(self.micro_batch_size):
            m, weight, loss = self._accumulate(mb, num_tokens, n_seq, n_micro)
            for k, v in [*((k, v * weight) for k, v in m.items()), ("tokens", weight), ("loss", loss)]:
                sums[k] = sums.get(k, 0.0) + v
        if acc.num_processes > 1:
            average_gradients(self.params, acc)
            sums = self._sum_over_processes(sums)
        loss_total, tokens = sums.pop("loss") / acc.num_processes, max(sums.pop("tokens"), 1.0)
        # clip_grad_norm_ also measures the norm; with no clipping (max_grad_norm 0) it scales by 1.
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm or math.inf))
        lr = self.scheduler.get_last_lr()[0]
        skipped = self._step_unless_nonfinite(loss_total, grad_norm)
        return {**{k: v / tokens for k, v in sums.items()}, "loss": loss_total, "grad_norm": grad_norm, "lr": lr,
                "skipped_nonfinite": float(skipped)}

    def _accumulate(self, mb: dict[str, Any], num_tokens: float, n_seq: int, n_micro: int) -> tuple[dict[str, float], float, float]:
        """Forward, loss and backward of one micro-batch (gradients add up in .grad); returns
        (loss metrics, the micro-batch's loss tokens, its scaled loss). The memory probe runs it too."""
        cfg = self.config
        logp, entropy = self._forward_log_probs(mb, return_entropy=True)
        ref = mb["ref_logp"]
        if ref is None and cfg.beta != 0:  # the reference equals the policy this step (training_step)
            ref = mb["old_logp"] if mb["old_logp"] is not None else logp.detach()
        loss, m = grpo_loss(logp, mb["old_logp"], ref, mb["advantages"], mb["completion_mask"],
                            num_tokens=num_tokens, **self.loss_settings)
        loss = loss * accumulation_scale(cfg.loss_type, mb["input_ids"].shape[0], n_seq, n_micro)
        loss.backward()
        weight = float(mb["completion_mask"].sum())
        m["entropy"] = (entropy * mb["completion_mask"]).sum().item() / max(weight, 1.0)
        return m, weight, loss.item()

    def _plan_memory(self) -> MemoryPlan | None:
        """micro_batch_size / gradient_checkpointing 'auto' and the memory preflight (memory.py): one
        worst-case probe of the real loss path, no optimizer step, gradients dropped, RNG states
        restored. None when both are fixed in the config (then nothing is probed, as before)."""
        cfg, device = self.config, self.accelerator.device
        if cfg.micro_batch_size != "auto" and cfg.gradient_checkpointing != "auto":
            return None
        prompt = longest_prompt(self.tokenizer, list(self.train_dataset["prompt"]), cfg.max_prompt_length)
        tokens = (prompt, cfg.max_completion_length)
        embeddings = self.model.get_input_embeddings().weight
        vocab = embeddings.shape[0]
        available = available_bytes(device)
        if self.accelerator.num_processes > 1:  # plan for the tightest process
            least = torch.tensor([available[0]], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
            available = (float(least.item()), available[1])
        size_hint = (f"To fit: lower max_completion_length (now {cfg.max_completion_length}) or max_prompt_length (now "
                     f"{cfg.max_prompt_length}); ")
        rng, was_training = ckpt.rng_state(), self.model.training
        try:
            plan = plan_memory(
                lambda m, train: self._probe_pass(m, train, tokens), lambda on: set_gradient_checkpointing(self.model, on),
                batch=cfg.generation_batch, micro_batch_size=cfg.micro_batch_size,
                gradient_checkpointing=cfg.gradient_checkpointing, budget_fraction=cfg.memory_budget,
                available=available, optimizer=optimizer_state_bytes(self.params, cfg.optimizer),
                rollout=rollout_bytes(self.model.config, cfg.generation_batch, sum(tokens), embeddings.dtype, vocab),
                tokens=tokens, device=device,
                fix_hint=size_hint + ("" if cfg.quantization == "4bit" else "quantization=4bit (frees the weights' memory); ")
                + f"a smaller lora_r (now {cfg.lora_r}) or logprob_chunk_size (now {cfg.logprob_chunk_size}: the LM head's "
                f"float32 logits are chunk × vocab {vocab}); a smaller model; or free memory / raise memory_budget.",
                rollout_hint=f"Lower prompts_per_step (now {cfg.prompts_per_step}) or num_generations (now "
                f"{cfg.num_generations}); " + size_hint + "a smaller model; or free memory / raise memory_budget.",
            )
        finally:
            ckpt.set_rng_state(rng)
            self.model.train(was_training)
        if self.accelerator.num_processes > 1:  # every process the same sizes (CPU measurements vary a little)
            from accelerate.utils import broadcast_object_list

            chosen = broadcast_object_list([(plan.micro_batch_size, plan.gradient_checkpointing)])[0]
            plan.micro_batch_size, plan.gradient_checkpointing = chosen
            set_gradient_checkpointing(self.model, chosen[1])
        return plan

    def _probe_pass(self, m: int, train: bool, tokens: tuple[int, int]) -> None:
        """One worst-case micro-batch of m sequences of tokens = (prompt, completion): the loss path
        of optimize() with backward (train), or log_probs()'s no-grad forward. The gradients are
        dropped, no optimizer step; the caller restores the RNG states and the training flag."""
        vocab = self.model.get_input_embeddings().weight.shape[0]
        mb = worst_case_micro_batch(m, *tokens, vocab, self.accelerator.device, old_logp=self.config.num_iterations > 1)
        self.model.train(train)
        if not train:
            with torch.no_grad():
                self._forward_log_probs(mb)
            return
        try:
            self._accumulate(mb, float(m * tokens[1]), m, 1)
        finally:
            for p in self.params:
                p.grad = None

    def _sum_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        if self.accelerator.num_processes == 1:
            return values
        keys = sorted(values)
        totals = self.accelerator.reduce(torch.tensor([values[k] for k in keys], device=self.accelerator.device), "sum")
        return dict(zip(keys, totals.tolist()))

    def _step_unless_nonfinite(self, loss: float, grad_norm: float) -> bool:
        """Step the optimizer, or skip a NaN/inf update (every process decides alike: the values are
        already averaged). Too many skips in a row end the run. Returns whether it skipped."""
        cfg = self.config
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.reference_is_policy = False
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        self.scheduler.step()  # the schedule follows the step count, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            logger.warning("step %d: loss %s, grad norm %s: update skipped (%d in a row)",
                           self.step + 1, loss, grad_norm, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row >= cfg.max_nonfinite_updates:
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf for {self.nonfinite_in_a_row} updates in a row (up to step "
                f"{self.step + 1}); each was skipped, the adapters hold the last finite update. Common causes: "
                f"a learning rate too high (learning_rate={cfg.learning_rate}), float16 without loss scaling "
                f"(torch_dtype={cfg.torch_dtype!r}; use bfloat16 or float32), or a reward of extreme magnitude. "
                f"Resume from the last checkpoint with a lower learning_rate, or raise max_nonfinite_updates."
            )
        return not finite

    def sync_reference(self) -> dict[str, float]:
        """Sync the reference slot to the policy now, with the configured alpha and mode; with
        ref_sync_reset_optimizer / ref_sync_restart_warmup also reset the optimizer's state / restart
        the LR warmup (ProRL, Liu et al. 2025 §2.3.1). A plateau that was due is consumed."""
        cfg = self.config
        metrics = sync_reference(self.model, cfg.ref_sync_alpha, cfg.ref_sync_mode)
        self.reference_is_policy = cfg.ref_sync_alpha == 1.0  # a hard sync is an exact copy
        if cfg.ref_sync_reset_optimizer:
            reset_optimizer_state(self.optimizer)
            metrics["sync/optimizer_reset"] = 1.0
        if self.warmup_restarts is not None:
            self.warmup_restarts.restart(self.optimizer, self.scheduler)
            metrics["sync/warmup_restart"] = 1.0
        self.sync_schedule.synced()
        return metrics

    def _observe_eval(self, metrics: dict[str, float]) -> None:
        """The plateau trigger's input: the first reward function's greedy eval score (the
        summary's accuracy)."""
        self.sync_schedule.observe_eval(metrics[f"eval/{reward_names(self.reward_funcs)[0]}"])

    @torch.no_grad()
    def evaluate(self, dataset=None, batch_prompts: int = 64) -> dict[str, float]:
        """eval/<reward> and eval/completion_length of one greedy completion per prompt; with
        eval_pass_k, eval/pass@k of eval_num_samples sampled ones (correct: the first reward function
        ≥ eval_correct_threshold); with eval_kl_to_base, eval/kl_to_base: the k3 KL per token of the
        policy to the model the run started from, on completions sampled at the training temperature
        (pass@k's when they are, else one more per prompt; evaluation.py). Processes split the prompts
        in chunks of batch_prompts and gather the results: each prompt counts once, every process
        returns the same metrics (evaluation.py)."""
        cfg, acc = self.config, self.accelerator
        dataset = self.eval_dataset if dataset is None else dataset
        n = num_eval_samples(cfg.eval_pass_k, cfg.eval_num_samples)
        temperature = cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature
        per_decode = max(1, max(batch_prompts, cfg.generation_batch) // max(n, 1))  # prompts per sampled decode
        kl_on_pass_k = cfg.eval_kl_to_base and n > 0 and temperature == cfg.temperature  # samples of the policy itself
        results = []
        for chunk, start, stop in eval_chunks(len(dataset), batch_prompts, acc.num_processes, acc.process_index):
            rows = dataset[start:stop]
            greedy = self.generate(rows["prompt"], num_generations=1, temperature=0.0)  # draws nothing
            scores = self.rewards(greedy, rows, 1)[1]  # (m, F), NaN where a function returned None
            correct, kl = None, []
            if n:
                # The chunk's own generator: the training sampling stream stays untouched and the
                # draws do not depend on the process that evaluates the chunk.
                generator = chunk_generator(cfg.seed, chunk, acc.device)
                first = []
                for s in range(0, stop - start, per_decode):
                    sub = {key: values[s : s + per_decode] for key, values in rows.items()}
                    sampled = self.generate(sub["prompt"], num_generations=n, temperature=temperature, generator=generator)
                    first.append(self.rewards(sampled, sub, n)[1][:, 0])
                    if kl_on_pass_k:
                        kl.append(self._kl_to_base(sampled, n))
                correct = count_correct(torch.cat(first), n, cfg.eval_correct_threshold)
            if cfg.eval_kl_to_base and not kl_on_pass_k:  # one sample per prompt, from the chunk's second stream
                generator = chunk_generator(cfg.seed, chunk, acc.device, stream=1)
                sampled = self.generate(rows["prompt"], num_generations=1, temperature=cfg.temperature, generator=generator)
                kl.append(self._kl_to_base(sampled, 1))
            results += prompt_results(start, scores, greedy.completion_lengths, correct, torch.cat(kl) if kl else None)
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            results = gather_object(results)
        return eval_metrics(results, reward_names(self.reward_funcs), cfg.eval_pass_k, n, len(dataset))

    @torch.no_grad()
    def _kl_to_base(self, rollout: Rollout, group_size: int) -> Tensor:
        """(m, 2) per prompt of the rollout: Σ k3 KL(policy ‖ start) over its group_size sampled
        completions' tokens, and their number (evaluation.py gives the estimator). One forward per
        rollout under each model, in eval mode, not split by micro_batch_size: the sums must not depend
        on the process or its memory plan (a CPU matmul may round a row differently in another batch
        shape); the decode that sampled the rollout held a larger KV cache for the same sequences."""
        mb = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
              "completion_length": rollout.completion_ids.shape[1]}
        was_training = self.model.training
        self.model.eval()
        try:
            logp, _ = self._forward_log_probs(mb)
            with base_forward(self.model):
                start, _ = self._forward_log_probs(mb)
        finally:
            self.model.train(was_training)
        mask = rollout.completion_mask.to(device=logp.device, dtype=torch.float32)
        k3 = k3_kl(logp.float(), start.float()) * mask
        return torch.stack([k3.sum(1), mask.sum(1)], 1).reshape(-1, group_size, 2).sum(1)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """output_dir/checkpoint-{step}: both adapters, optimizer, scheduler, data position, every
        process's RNG states. Atomic (see checkpoint.py).

        Called on every process: each one's RNG states are gathered; the main process writes.
        """
        from accelerate.utils import gather_object

        rng = {**ckpt.rng_state(), "sampling": self.generator.get_state()}
        rngs = gather_object([rng]) if self.accelerator.num_processes > 1 else [rng]
        target = self.output_dir / f"checkpoint-{self.step}"
        if self.is_main:
            blobs = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": rngs}
            state = {
                "step": self.step,
                "batches": self.batches.state_dict(),
                "history": self.history,
                "num_processes": self.accelerator.num_processes,
                "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "reference_is_policy": self.reference_is_policy,
                "sync_schedule": self.sync_schedule.state_dict(),  # the plateau trigger's best score and count
                "warmup_restart_update": None if self.warmup_restarts is None else self.warmup_restarts.restart_update,
                # the sizes in use ('auto' resolved): a resumed 'auto' run keeps them when they still fit
                "micro_batch_size": self.micro_batch_size,
                "gradient_checkpointing": self.gradient_checkpointing,
            }
            self._write(
                f"checkpoint {target.name}",
                lambda: ckpt.save_checkpoint(target, self.model, blobs=blobs, state=state, config_yaml=self.config.to_yaml()),
            )
            ckpt.rotate_checkpoints(self.output_dir, self.config.save_total_limit)
            self.reporter.plot()  # metrics.png so far (a failure is only a warning)
        self.accelerator.wait_for_everyone()
        return target if self.is_main else None

    def _write(self, what: str, write: Callable[[], Any]) -> None:
        """Run a write; an OSError (disk full, no permission) becomes one clear error. The atomic
        write leaves the previous checkpoint or adapter as it was."""
        try:
            write()
        except OSError as e:
            kept = ckpt.list_checkpoints(self.output_dir)
            previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
            raise OSError(
                e.errno,
                f"could not write {what} in {self.output_dir} ({e.strerror or e}); {previous}. Free space or fix "
                f"the permissions of output_dir, then resume with --set resume_from_checkpoint=latest",
            ) from e

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint dir, or 'latest' in output_dir; clear errors for anything else."""
        path = ckpt.resolve_checkpoint(path, self.output_dir)
        state, blobs = ckpt.load_checkpoint_state(path)
        ckpt.check_compatible(
            path, self.config.to_dict(), self.accelerator.num_processes, int(state.get("num_processes", len(blobs["rng"]))),
            policy_targets=set(self.model.peft_config[POLICY].target_modules),
        )
        ckpt.load_checkpoint_adapters(self.model, path)
        self.optimizer.load_state_dict(blobs["optimizer"])
        self.scheduler.load_state_dict(blobs["scheduler"])
        if self.warmup_restarts is not None:  # before apply_config, which evaluates the LR multipliers
            self.warmup_restarts.restart_update = state.get("warmup_restart_update")
        saved_lr = apply_optimizer_config(self.optimizer, self.scheduler, self.config)
        if saved_lr != self.config.learning_rate:
            self._print(f"learning_rate {saved_lr:g} in the checkpoint, {self.config.learning_rate:g} in this config: "
                        f"using {self.config.learning_rate:g}")
        rng = blobs["rng"][self.accelerator.process_index]  # this process's own states
        ckpt.set_rng_state(rng)
        self.generator.set_state(rng["sampling"])
        self.step = state["step"]
        self.batches.load_state_dict(state["batches"])
        self.history = state.get("history", [])
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self.reference_is_policy = state.get("reference_is_policy", False)  # unknown: run the reference forward
        self.sync_schedule.load_state_dict(state.get("sync_schedule", {}))
        self._resume_sizes(state)
        if self.is_main:
            for moved in ckpt.set_aside_later_checkpoints(self.output_dir, self.step):
                self._print(f"{moved.name}: a later checkpoint of the run this one resumes, set aside (not deleted)")
        self._print(f"resumed from {path} at step {self.step}")

    def _resume_sizes(self, state: dict[str, Any]) -> None:
        """An 'auto' run resumes with the checkpoint's sizes when the probe found them to fit (the
        same accumulation order: an exact resume); otherwise it keeps this start's."""
        plan, saved = self.memory_plan, (state.get("micro_batch_size"), state.get("gradient_checkpointing"))
        if plan is None or saved == (self.micro_batch_size, self.gradient_checkpointing) or None in saved:
            return
        if not plan.fits(*saved):
            self._print(f"the checkpoint ran micro_batch_size {saved[0]}, gradient_checkpointing {saved[1]}; that does "
                        f"not fit now: using {self.micro_batch_size}, {self.gradient_checkpointing}")
            return
        size_auto, ckpt_auto = self.config.micro_batch_size == "auto", self.config.gradient_checkpointing == "auto"
        self.micro_batch_size = saved[0] if size_auto else self.micro_batch_size
        if ckpt_auto and saved[1] != self.gradient_checkpointing:
            self.gradient_checkpointing = saved[1]
            set_gradient_checkpointing(self.model, saved[1])
        plan.micro_batch_size, plan.gradient_checkpointing = self.micro_batch_size, self.gradient_checkpointing
        self._print(f"resumed with the checkpoint's micro_batch_size {self.micro_batch_size}, gradient_checkpointing "
                    f"{'on' if self.gradient_checkpointing else 'off'}")

    def _stop(self, signum: int) -> None:
        """After a stop signal: write a checkpoint, then raise TrainingInterrupted with how to resume."""
        target = self.save_checkpoint()
        name = signal.Signals(signum).name
        message = (
            f"{name}: stopped after step {self.step}/{self.total_steps}; checkpoint written to {target}. "
            f"Resume with: lora-grpo train <recipe> --set output_dir={self.output_dir} --set resume_from_checkpoint=latest"
        )
        self._print(message)
        raise TrainingInterrupted(message, signum, target)

    def _check_log_probs(self) -> float:
        """Refuse a model whose own logits our chunked log-probs do not reproduce (an unknown
        transform after its LM head): two prompts, then four of their own tokens as a completion."""
        ids, mask = _tokenize_left_padded(self.tokenizer, list(self.train_dataset[:2]["prompt"]), None)
        ids, mask = ids[:, -32:], mask[:, -32:]  # the prompts' ends (left-padded rows) are enough
        completion = ids[:, -4:]
        device = next(self.model.parameters()).device
        return check_log_probs(
            self.model,
            torch.cat([ids, completion], 1).to(device),
            torch.cat([mask, torch.ones_like(completion)], 1).to(device),
            completion_length=completion.shape[1],
            temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size,
        )

    # ------------------------------------------------------------------ reporting
    def _summary(self, before: dict, after: dict, seconds: float) -> dict[str, Any]:
        rewards = [m["reward/mean"] for m in self.history if "reward/mean" in m]
        k = max(1, len(rewards) // 10)
        summary: dict[str, Any] = {
            "steps": self.step,
            "seconds": round(seconds, 2),  # train() itself
            "total_seconds": round(time.perf_counter() - self._created, 2),  # plus model load (and toy pretraining)
            # the reward curve's start and end: means over its first and last tenth
            "reward_first": float(np.mean(rewards[:k])) if rewards else None,
            "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
            "syncs": sum(1 for m in self.history if m.get("sync/event")),
            "log_prob_check_max_diff": self.log_prob_check,  # chunked log-probs vs the model's logits, at load
            "micro_batch_size": self.micro_batch_size,  # 'auto' resolved
            "gradient_checkpointing": self.gradient_checkpointing,
        }
        if self.memory_plan is not None:
            plan = self.memory_plan
            summary["memory"] = {"peak_mib": round(plan.need / MiB, 1), "budget_mib": round(plan.budget / MiB, 1),
                                 "rollout_mib": round(plan.rollout / MiB, 1), "probe_seconds": round(plan.seconds, 2)}
        if before or after:
            # The first reward function is the headline eval metric (accuracy on the toy task).
            first = f"eval/{reward_names(self.reward_funcs)[0]}"
            summary["accuracy_before"] = before.get(first)
            summary["accuracy_after"] = after.get(first)
            # KL per token of the policy to the model the run started from (0 before a fresh run)
            summary["kl_to_base_before"] = before.get("eval/kl_to_base")
            summary["kl_to_base_after"] = after.get("eval/kl_to_base")
            summary["eval_before"], summary["eval_after"] = before, after
        return summary

    def _report_eval(self, when: str, metrics: dict[str, float]) -> None:
        self._print(f"eval {when} training: {self._fmt(metrics)}")
        self.reporter.log({"step": self.step, **metrics})

    def _print(self, text: str) -> None:
        self.reporter.print(text)  # through the progress bar (tqdm.write), main process only

    @staticmethod
    def _fmt(metrics: dict[str, float]) -> str:
        return " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))

    def _progress_line(self, m: dict[str, Any]) -> str:
        parts = [
            f"step {self.step}/{self.total_steps}",
            f"reward {m.get('reward/mean', float('nan')):.3f}±{m.get('reward/std', float('nan')):.3f}",
            f"kl {m.get('kl', 0.0):.4f}",
            f"len {m.get('completion_length/mean', 0.0):.1f}",
            f"zero-std {m.get('frac_reward_zero_std', 0.0):.2f}",
            f"{m.get('time/step', 0.0):.1f}s",
        ]
        if m.get("sync/event"):
            parts.append(f"sync({m['sync/reason']}, err {m['sync/truncation_error']:.1e})")
        if "eval/completion_length" in m:
            parts.append(self._fmt({k: v for k, v in m.items() if k.startswith("eval/")}))
        return " | ".join(parts)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
