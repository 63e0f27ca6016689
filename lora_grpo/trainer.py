"""GRPOTrainer: the loop. It orchestrates the stages; the math lives in the pure modules.

One optimizer step:

    prompts ─► rollout (policy adapter, no grad) ─► rewards ─► advantages ─► Batch (loss mask)
            ─► old log-probs (only if num_iterations > 1) ─► reference log-probs (reference adapter;
               skipped if beta = 0 or while the slot provably equals the policy)
            ─► num_iterations × [micro-batched loss + backward, clip, optimizer + LR step]
            ─► eval if due ─► maybe sync the reference slot ─► metrics, callbacks, checkpoint

The loop's mutable state is one object, `trainer.state` (state.TrainState); evaluation
(evaluation.Evaluator), the start-up checks (startup.py), the memory plan (memory.py) and the run's
files (checkpoint.py, reporting.py) live in their own modules.

Simplifications, on purpose: generation runs with the training model (no vLLM); the batch of one
step is generated once and reused num_iterations times; gradients of several processes are
averaged explicitly after accumulation (each process holds its own base and both adapters, and a
prompt's whole group stays on one process).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import checkpoint as ckpt
from .adapters import POLICY, policy_parameters, reference_forward
from .advantages import group_advantages, zero_std_fraction
from .batch import Batch
from .config import ConfigError, GRPOConfig
from .data import PROMPT_MESSAGES, PromptBatches, process_shard, resolve_datasets
from .evaluation import Evaluator, headline_score
from .memory import MemoryPlan, plan_run_memory, resume_sizes
from .model import keep_4bit_weights_fixed, load_model, set_gradient_checkpointing
from .optim import apply_config as apply_optimizer_config
from .optim import WarmupRestarts, build_optimizer, build_scheduler, reset_optimizer_state
from .reference import SyncSchedule, sync_reference
from .reporting import RunReporter, accelerator_kwargs, format_metrics, progress_line, run_summary
from .rewards import TrainerState, check_reward_weights, compute_rewards, resolve_reward_funcs, reward_metrics, reward_names
from .rewards import rollout_keywords
from .rng import rng_state, seed_everything
from .rollout import Rollout, generate_rollout
from .startup import check_datasets, check_model_log_probs, check_special_tokens
from .state import TrainState
from .stopping import StopSignals, TrainingInterrupted, agreed_signal
from .update import PolicyUpdate

Tensor = torch.Tensor


class GRPOTrainer:
    """GRPO with a LoRA policy and a reference slot on one (optionally 4-bit) base.

    >>> trainer = GRPOTrainer(config, reward_funcs=[correctness], train_dataset=ds)   # doctest: +SKIP
    >>> trainer.train()                                                               # doctest: +SKIP

    `trainer.model` is the peft model with the adapters "policy" and "reference" (and "base", a
    frozen copy of init_adapter, in a warm-started run: what eval/kl_to_base measures from);
    `trainer.state` the loop's state (global_step, log_history, ...); `trainer.sync_reference()`
    syncs the reference slot now and returns the sync's metrics.
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
        self.reward_names = reward_names(self.reward_funcs)

        # The same seed on every process: the adapters must start identical (sampling has its own
        # per-process generator below).
        seed_everything(config.seed)
        if model is None:
            device_map = {"": self.accelerator.device} if self.accelerator.device.type == "cuda" else None
            model, tokenizer = load_model(config, device_map=device_map)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self.model, self.tokenizer = model, tokenizer
        keep_4bit_weights_fixed(model)  # also for a model the caller built (see model.py)
        if next(model.parameters()).device != self.accelerator.device and not getattr(model, "is_loaded_in_4bit", False):
            self.model.to(self.accelerator.device)

        self.train_dataset, self.eval_dataset = resolve_datasets(config, train_dataset, eval_dataset, tokenizer)
        # Start-up checks (startup.py): reward columns, every prompt against the context (tokenised
        # once), special tokens, the log-probs against the model's own logits.
        self.prompt_lengths = check_datasets(self.reward_funcs, {"train_dataset": self.train_dataset,
                                             "eval_dataset": self.eval_dataset}, tokenizer, model, config)
        check_special_tokens(self.model, self.tokenizer)
        self.log_prob_check = check_model_log_probs(self.model, self.tokenizer, list(self.train_dataset[:2]["prompt"]), config)
        # Each process samples its own prompts, an equal share (data.process_shard).
        self.train_dataset = process_shard(self.train_dataset, self.accelerator.num_processes, self.accelerator.process_index)
        batches = PromptBatches(self.train_dataset, config.prompts_per_step, seed=config.seed)
        self.total_steps = config.max_steps or config.num_epochs * batches.steps_per_epoch
        self.params = policy_parameters(self.model)
        self.optimizer = build_optimizer(self.params, config)
        # ref_sync_restart_warmup: the warmup restarts at each sync (its state is in the TrainState)
        warmup_restarts = WarmupRestarts(config.warmup_steps * config.num_iterations)
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps,
                                         warmup_restarts if config.ref_sync_restart_warmup else None)
        if config.ref_sync_on_plateau and self.eval_dataset is None:
            raise ConfigError("ref_sync_on_plateau=true watches the eval score, but there are no eval prompts: set "
                              "eval_dataset (or pass eval_dataset=...), or turn it off")
        self.generator = torch.Generator(device=self.accelerator.device).manual_seed(
            config.seed + 1000 * self.accelerator.process_index
        )
        self.state = TrainState(  # the loop's mutable state, saved and restored whole (state.py)
            max_steps=self.total_steps, logging_steps=config.logging_steps, eval_steps=config.eval_steps,
            save_steps=config.save_steps, is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process, num_processes=self.accelerator.num_processes,
            batches=batches, sync_schedule=SyncSchedule.from_config(config), warmup_restarts=warmup_restarts,
            micro_batch_size=config.micro_batch_size, gradient_checkpointing=config.gradient_checkpointing,
        )
        self.update = PolicyUpdate(config, self.model, self.params, self.optimizer, self.scheduler, self.accelerator,
                                   self.state)  # one optimizer update (update.py)
        self.memory_plan: MemoryPlan | None = None  # made when training starts (plan_memory)
        self._planned = False
        self.output_dir = Path(config.output_dir)
        self.is_main = self.accelerator.is_main_process
        self.reporter = RunReporter(config, self.accelerator, self.reward_names, self.total_steps)
        self.evaluator = Evaluator(
            config, self.accelerator, self.reward_names, model=self.model,
            sample=lambda prompts, n, temperature, generator: self.generate(prompts, n, temperature, generator),
            score=lambda rollout, rows, n: self.rewards(rollout, rows, n)[1],
            log_probs=lambda mb: self.update.forward(mb)[0],
        )
        self._last_samples = None  # the last step's samples for completions.jsonl (set by advantages())
        # Named points of the loop where callbacks fire: each hook is called as hook(event, trainer).
        self.hooks: list[Callable[[str, GRPOTrainer], None]] = []

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to total_steps; returns the run summary (also written to summary.json)."""
        cfg, state = self.config, self.state
        start = time.perf_counter()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.to_yaml(self.output_dir / "config.yaml")
        plan = self.plan_memory()  # before any rollout: the probe is also the preflight
        if cfg.resume_from_checkpoint:
            self.load_checkpoint(cfg.resume_from_checkpoint)
        self.reporter.start(state.global_step, resumed=bool(cfg.resume_from_checkpoint))  # logs truncated or fresh; trackers
        if plan is not None:  # what 'auto' chose
            self._print(plan.describe(cfg.micro_batch_size == "auto", cfg.gradient_checkpointing == "auto"))
        self._event("train_begin")
        eval_before = self._evaluate_and_log("before") if self.eval_dataset is not None and state.global_step == 0 else {}
        # Stop signals are deferred until the end of the run, final eval and saves included.
        with StopSignals() as stop:
            with self.reporter.progress(state.global_step):
                while state.global_step < self.total_steps:
                    epoch, rows = next(state.batches)
                    self._event("step_begin")
                    metrics = self.training_step(rows)
                    state.global_step += 1
                    state.epoch = state.global_step / state.batches.steps_per_epoch
                    metrics["epoch"] = epoch
                    self._end_step(metrics, epoch_ended=state.batches.epoch != epoch, stop=stop)
            eval_after = self._evaluate_and_log("after") if self.eval_dataset is not None else {}
            self.save_checkpoint()
            if self.is_main:
                ckpt.explain_write_failure("the final adapter", self.output_dir,
                                           lambda: ckpt.save_adapter(self.model, self.output_dir / "adapter", POLICY))
        summary = run_summary(
            state.log_history, steps=state.global_step, seconds=time.perf_counter() - start,
            total_seconds=time.perf_counter() - self._created, log_prob_check=self.log_prob_check,
            micro_batch_size=self.micro_batch_size, gradient_checkpointing=self.gradient_checkpointing,
            memory_plan=self.memory_plan, headline=f"eval/{self.reward_names[0]}", before=eval_before, after=eval_after,
        )
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.reporter.finish()
        self._event("train_end")
        return summary

    def _end_step(self, metrics: dict[str, Any], *, epoch_ended: bool, stop: StopSignals) -> None:
        """After an optimizer step: eval if due, then the sync decision, log, stop signal, checkpoint."""
        cfg, state = self.config, self.state
        step = state.global_step
        # Eval before the sync decision, so that the plateau trigger reads this step's eval. For every
        # other trigger the order is free: eval reads only the policy and the start (base_forward), a
        # sync writes only the reference slot and the optimizer.
        if self.eval_dataset is not None and cfg.eval_steps and step % cfg.eval_steps == 0 and step < self.total_steps:
            metrics.update(self.evaluate())
            state.sync_schedule.observe_eval(headline_score(metrics, self.reward_names))
        reason = state.sync_schedule.due(step, epoch_ended=epoch_ended, kl=metrics.get("kl"))
        if reason:
            metrics.update(self.sync_reference())
            metrics["sync/event"] = 1.0
            metrics["sync/reason"] = reason
        state.log_history.append(metrics)
        self.reporter.log_step(step, metrics, self._last_samples)  # metrics, completions, trackers, bar
        self._event("log")
        if step % cfg.logging_steps == 0 or step == self.total_steps:
            self._print(progress_line(step, self.total_steps, metrics))
        signum = agreed_signal(stop.received, self.accelerator.num_processes, self.accelerator.device)
        if signum:
            self._stop(signum)
        self._event("step_end")
        if cfg.save_steps and step % cfg.save_steps == 0 and step < self.total_steps:
            self.save_checkpoint()

    def training_step(self, rows: dict[str, list]) -> dict[str, float]:
        """One optimizer step (num_iterations passes) on one batch of prompts; returns flat metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        rollout = self.generate(rows["prompt"])
        t_gen = time.perf_counter()
        advantages, metrics = self.advantages(rollout, rows)
        batch = Batch.from_rollout(rollout, advantages, mask_truncated_completions=cfg.mask_truncated_completions)
        if cfg.num_iterations > 1:
            batch.old_logp = self.log_probs(batch)
        # A reference slot that provably equals the policy (a fresh or warm-started run before its
        # first update, right after a hard sync) costs no forward: optimize() uses the policy's own.
        if cfg.beta != 0 and not self.state.reference_is_policy:
            with reference_forward(self.model):
                batch.ref_logp = self.log_probs(batch)
        metrics["reference_reused_policy"] = float(cfg.beta != 0 and self.state.reference_is_policy)
        t_ref = time.perf_counter()
        skipped = 0.0
        for step_batch in batch.steps(1):  # where a generation batch is cut into optimizer steps
            for _ in range(cfg.num_iterations):
                metrics.update(self.optimize(step_batch))
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
            self.model, self.tokenizer, prompts,
            num_generations=num_generations or cfg.num_generations, max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length, temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
            generator=self.generator if generator is None else generator, decode_mode=cfg.decode_mode,
        )

    def rewards(self, rollout: Rollout, rows: dict[str, list], group_size: int):
        """Rewards (B,), per-function (B, F), metrics: every reward function called with TRL's keywords
        (rewards.rollout_keywords: dataset columns, chat messages, completion ids, trainer_state)."""
        step = self.state.global_step
        trainer_state = TrainerState(global_step=step, max_steps=self.total_steps, epoch=step / self.state.batches.steps_per_epoch)
        prompts, completions, columns = rollout_keywords(rollout, rows, group_size, trainer_state, PROMPT_MESSAGES)
        return compute_rewards(self.reward_funcs, prompts, completions, columns, weights=self.config.reward_weights)

    def advantages(self, rollout: Rollout, rows: dict[str, list]) -> tuple[Tensor, dict[str, float]]:
        """Rewards → group-relative advantages (B,), with the step's reward and completion metrics."""
        cfg = self.config
        rewards, per_func, metrics = self.rewards(rollout, rows, cfg.num_generations)
        advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
        self._last_samples = (rollout.prompts, rollout.completions, per_func, rewards, advantages)  # for log_completions
        lengths, truncated = rollout.completion_lengths.float(), rollout.truncated.float()
        if self.accelerator.num_processes > 1:  # metrics over every process's groups, not just this one's
            rewards, per_func, lengths, truncated = (
                self.accelerator.gather(t.to(self.accelerator.device)).cpu() for t in (rewards, per_func, lengths, truncated)
            )
            metrics = reward_metrics(rewards, per_func, self.reward_names)
        metrics.update({
            "frac_reward_zero_std": zero_std_fraction(rewards, cfg.num_generations),
            "completion_length/mean": lengths.mean().item(),
            "completion_length/max": lengths.max().item(),
            "truncated_fraction": truncated.mean().item(),
        })
        return advantages, metrics

    def log_probs(self, batch: Batch) -> Tensor:
        """(B, T) per-token log-probs under the active adapter, in eval mode (as sampled)."""
        return self.update.log_probs(batch, self.micro_batch_size)

    def optimize(self, batch: Batch) -> dict[str, float]:
        """One optimizer update on the batch (update.PolicyUpdate): accumulate → average → clip → step."""
        return self.update(batch, self.micro_batch_size)

    def sync_reference(self) -> dict[str, float]:
        """Sync the reference slot to the policy now, with the configured alpha and mode; with
        ref_sync_reset_optimizer / ref_sync_restart_warmup also reset the optimizer's state / restart
        the LR warmup (ProRL, Liu et al. 2025 §2.3.1). A plateau that was due is consumed."""
        cfg, state = self.config, self.state
        metrics = sync_reference(self.model, cfg.ref_sync_alpha, cfg.ref_sync_mode)
        state.reference_is_policy = cfg.ref_sync_alpha == 1.0  # a hard sync is an exact copy
        if cfg.ref_sync_reset_optimizer:
            reset_optimizer_state(self.optimizer)
            metrics["sync/optimizer_reset"] = 1.0
        if cfg.ref_sync_restart_warmup:
            state.warmup_restarts.restart(self.optimizer, self.scheduler)
            metrics["sync/warmup_restart"] = 1.0
        state.sync_schedule.synced()
        return metrics

    def evaluate(self, dataset=None, batch_prompts: int = 64) -> dict[str, float]:
        """eval/* metrics of the policy on `dataset` (default: the eval dataset); evaluation.Evaluator."""
        metrics = self.evaluator.evaluate(self.eval_dataset if dataset is None else dataset, batch_prompts)
        self._event("evaluate")
        return metrics

    def _evaluate_and_log(self, when: str) -> dict[str, float]:
        """The eval before or after training: printed, logged at the current step; 'before' feeds the plateau trigger."""
        metrics = self.evaluate()
        self._print(f"eval {when} training: {format_metrics(metrics)}")
        self.reporter.log({"step": self.state.global_step, **metrics})
        if when == "before":
            self.state.sync_schedule.observe_eval(headline_score(metrics, self.reward_names))
        return metrics

    # ------------------------------------------------------------------ sizes: the memory plan
    def plan_memory(self) -> MemoryPlan | None:
        """micro_batch_size / gradient_checkpointing 'auto' and the memory preflight (memory.py), once,
        when training starts (an eval-only trainer never probes). None when both are fixed."""
        cfg = self.config
        if not self._planned:
            self._planned = True
            if cfg.micro_batch_size == "auto" or cfg.gradient_checkpointing == "auto":
                self.memory_plan = plan_run_memory(
                    self.update, device=self.accelerator.device, num_processes=self.accelerator.num_processes,
                    longest_prompt=self.prompt_lengths["train_dataset"].longest,
                )
                self.state.micro_batch_size = self.memory_plan.micro_batch_size
                self.state.gradient_checkpointing = self.memory_plan.gradient_checkpointing
        return self.memory_plan

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward: the config's, or the memory plan's for 'auto' (planned on first use)."""
        if self.state.micro_batch_size == "auto":
            self.plan_memory()
        return self.state.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int) -> None:
        self.state.micro_batch_size = value

    @property
    def gradient_checkpointing(self) -> bool:
        if self.state.gradient_checkpointing == "auto":
            self.plan_memory()
        return self.state.gradient_checkpointing

    @property
    def step(self) -> int:
        """Optimizer steps done (state.global_step)."""
        return self.state.global_step

    @property
    def history(self) -> list[dict[str, Any]]:
        """One metrics record per step (state.log_history)."""
        return self.state.log_history

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """output_dir/checkpoint-{step}: both adapters, optimizer, scheduler, every process's RNG
        states, and the TrainState whole. Atomic (checkpoint.py). Called on every process: each
        one's RNG states are gathered; the main process writes."""
        from accelerate.utils import gather_object

        rng = {**rng_state(), "sampling": self.generator.get_state()}
        rngs = gather_object([rng]) if self.accelerator.num_processes > 1 else [rng]
        target = self.output_dir / f"checkpoint-{self.state.global_step}"
        if self.is_main:
            blobs = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": rngs}
            state = self.state.state_dict()
            ckpt.explain_write_failure(f"checkpoint {target.name}", self.output_dir, lambda: ckpt.save_checkpoint(
                target, self.model, blobs=blobs, state=state, config_yaml=self.config.to_yaml()))
            ckpt.rotate_checkpoints(self.output_dir, self.config.save_total_limit)
            self.reporter.plot()  # metrics.png so far (a failure is only a warning)
        self.accelerator.wait_for_everyone()
        self._event("save")
        return target if self.is_main else None

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint dir, or 'latest' in output_dir; clear errors for anything else."""
        path = ckpt.resolve_checkpoint(path, self.output_dir)
        self.plan_memory()  # the sizes this start can use (a checkpoint's 'auto' sizes are taken when they fit)
        state, current = self.state, (self.state.micro_batch_size, self.state.gradient_checkpointing)
        saved = ckpt.restore_training_state(
            path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, state=state,
            generator=self.generator, config_values=self.config.to_dict(),
            num_processes=self.accelerator.num_processes, process_index=self.accelerator.process_index,
        )
        saved_lr = apply_optimizer_config(self.optimizer, self.scheduler, self.config)  # after the warmup state
        if saved_lr != self.config.learning_rate:
            self._print(f"learning_rate {saved_lr:g} in the checkpoint, {self.config.learning_rate:g} in this config: "
                        f"using {self.config.learning_rate:g}")
        sizes, line = resume_sizes(self.memory_plan, self.config, current,
                                   (saved.get("micro_batch_size"), saved.get("gradient_checkpointing")))
        state.micro_batch_size = sizes[0]
        if sizes[1] != current[1]:
            set_gradient_checkpointing(self.model, sizes[1])
        state.gradient_checkpointing = sizes[1]
        if line:
            self._print(line)
        if self.is_main:
            for moved in ckpt.set_aside_later_checkpoints(self.output_dir, state.global_step):
                self._print(f"{moved.name}: a later checkpoint of the run this one resumes, set aside (not deleted)")
        self._print(f"resumed from {path} at step {state.global_step}")

    def _stop(self, signum: int) -> None:
        """After a stop signal: write a checkpoint, then raise TrainingInterrupted with how to resume."""
        target = self.save_checkpoint()
        name = signal.Signals(signum).name
        message = (
            f"{name}: stopped after step {self.state.global_step}/{self.total_steps}; checkpoint written to {target}. "
            f"Resume with: lora-grpo train <recipe> --set output_dir={self.output_dir} --set resume_from_checkpoint=latest"
        )
        self._print(message)
        raise TrainingInterrupted(message, signum, target)

    # ------------------------------------------------------------------ plumbing
    def _event(self, name: str) -> None:
        """A named point of the loop: train_begin, step_begin, log, step_end, evaluate, save, train_end.
        Callbacks hang here (the TRL front door dispatches to transformers' CallbackHandler)."""
        for hook in self.hooks:
            hook(name, self)

    def _print(self, text: str) -> None:
        self.reporter.print(text)  # through the progress bar (tqdm.write), main process only
