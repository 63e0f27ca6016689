"""GRPOTrainer: the loop. It orchestrates the stages; the math lives in the pure modules.

    prompts ─► generation_round: rollout (policy, no grad) ─► rewards ─► advantages (scorer.py) ─► Batch
               (dynamic_sampling: rollout and rewards in rounds of the next prompts until the step holds
               enough groups whose rewards differ, dynamic_sampling.py)
            ─► old log-probs (when the rollout feeds more than one update) ─► reference log-probs (the
               reference adapter; skipped if beta = 0 or while the slot provably equals the policy)
            ─► num_iterations × steps_per_generation optimizer steps (update.PolicyUpdate), each followed by
               eval if due ─► maybe sync the reference slot ─► metrics, callbacks, checkpoint (_end_step)

In the code, in run order: __init__ calls the builders (model, sampler, data, optimizer, stages), each
stage getting what it needs at construction; train() → _train: resume, begin, eval before, then
_run_steps walks _step_batches (a generator that owns the rollout, dynamic sampling and the steps
left of a generation: state.generation) through the update and _end_step; eval after, final save.

The loop's mutable state is `trainer.state` (state.TrainState); evaluation, start-up checks, the memory
plan and the run's files live in their own modules. On purpose: generation runs with the training model
(no vLLM); each process holds its own base and both adapters, and a prompt's whole group stays on it.
"""

from __future__ import annotations

import json
import math
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .batch import Batch, RolloutSteps, StepBatch
from .config import GRPOConfig
from .config_checks import require_eval_set
from .data.prompts import (
    LOCAL_DATASETS,
    PromptBatches,
    named_eval_sets,
    resolve_datasets,
    resolve_eval_dataset,
)
from .device import is_out_of_memory, mixed_precision_dtype, now, place_model
from .dynamic_sampling import Round, StepSample, dropped_kinds, informative_groups, sample_step, step_metrics
from .evaluation import Evaluator, headline_score, metric_names
from .memory.probe import MemoryPlan
from .memory.sizes import RunSizes
from .model.adapters import (
    POLICY,
    POLICY_DIR,
    REFERENCE,
    lora_layers,
    policy_parameters,
    reference_forward,
    set_training,
)
from .model.load import (
    attach_adapters,
    enable_gradient_checkpointing,
    keep_4bit_weights_fixed,
    load_model,
    prepare_base,
)
from .model.reference import sync_reference
from .optim import (
    LossScale,
    WarmupRestarts,
    build_optimizer,
    build_scheduler,
    refresh_lr,
    reset_optimizer_state,
    steps_of,
    sum_over_processes,
)
from .optim import apply_config as apply_optimizer_config
from .rewards.scoring import RewardFunctionError
from .rng import rng_state, sampling_seed, seed_everything, shuffle_seed
from .rollout import Rollout
from .rollout.sampling import NONFINITE_LOGITS
from .run import best, model_card
from .run import checkpoint as ckpt
from .run.failures import (
    LastFinishedStep,
    PeerFailed,
    StepFailed,
    agreed,
    agreed_failures,
    describe_stages,
    stage,
    stages_of,
)
from .run.hub import HubRepo, push_run
from .run.reporting import RunReporter, accelerator_kwargs, format_metrics, plain, progress_line, run_summary
from .run.run_dir import claim_for_run, kept_work, nothing_to_train, trained_already
from .run.stopping import StopSignals, TrainingInterrupted, agreed_signal
from .sampler import PolicySampler
from .scorer import RolloutScorer, place_reward_models, probe_passes, resolve_rewards
from .startup import check_datasets, check_generation_config, check_model_log_probs, check_special_tokens
from .state import StepFlow, TrainState
from .update import PolicyUpdate

Tensor = torch.Tensor
# What a rollout over logits that overflowed raises: torch.multinomial's words for a probability row with inf or NaN
# in it (sampling), or the greedy decode's own.
_NONFINITE_SAMPLING = ("probability tensor contains either `inf`, `nan` or element < 0", NONFINITE_LOGITS)


def eval_set_labels(eval_dataset) -> dict:
    """{label: Dataset} of a run's eval sets for the start-up checks' messages: eval_dataset, or
    eval_dataset[name] for each named set."""
    return {
        "eval_dataset" if name is None else f"eval_dataset[{name!r}]": rows
        for name, rows in named_eval_sets(eval_dataset).items()
    }


class GRPOTrainer:
    """GRPO with a LoRA policy and a reference slot on one (optionally 4-bit) base.

    Construction checks the reward functions first (a wrong one fails before the model loads), loads
    the model, resolves the datasets and runs the start-up checks (every prompt against the context,
    special tokens, reward columns, log-probs against the model's own logits); ``train()`` runs the loop.

    Args:
        config: the run's settings; every field is listed by ``help(GRPOConfig)``.
        reward_funcs: reward functions with TRL's contract (every argument by keyword), built-in
            names, dotted paths ``"pkg.module:fn"`` or ``RewardModel``s; None: ``config.reward_funcs``.
        train_dataset: a ``datasets.Dataset`` (or ``IterableDataset`` with ``max_steps``); None:
            ``config.dataset``.
        eval_dataset: held-out prompts for ``evaluate()``; None: ``config.eval_dataset``.
        model: a loaded causal LM to train instead of ``config.model_name_or_path`` (with ``tokenizer``): a
            base, which gets the policy and reference adapters of the config (as a loaded one does), or a
            model lora_grpo built (``lora_grpo.model.load.load_model``: both adapters already on it).
        tokenizer: the model's tokenizer; required with ``model``; given alone, the tokenizer of the config's
            model (a chat template of your own, added tokens: as TRL's ``processing_class``).
        tools: functions the policy may call in a rollout (typed, with Google-style docstrings);
            None: ``config.tools``.
        environment_factory: a class whose public methods are the tools, one instance per completion.

    Attributes:
        model: the peft model with the adapters "default" (the policy) and "reference" (and "base", a frozen copy
            of ``init_adapter``, in a warm-started run: what ``eval/kl_to_base`` measures from).
        state: the loop's state, transformers' ``TrainerState`` (``global_step``, ``log_history``, ...)
            and ours; checkpoints save and restore it whole.

    Example:
        >>> from lora_grpo import GRPOConfig, GRPOTrainer
        >>> from lora_grpo.tasks.toy import toy_problems, toy_reward
        >>> config = GRPOConfig(model_name_or_path="toy", quantization="4bit", max_steps=30,
        ...                     ref_sync_steps=10, ref_sync_alpha=0.6, output_dir="runs/example")
        >>> trainer = GRPOTrainer(config, reward_funcs=[toy_reward],              # doctest: +SKIP
        ...                       train_dataset=toy_problems(2000), eval_dataset=toy_problems(200, split="eval"))
        >>> summary = trainer.train()            # the summary.json of the run     # doctest: +SKIP
        >>> trainer.sync_reference()             # sync now: {"sync/truncation_error": ..., ...}  # doctest: +SKIP
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
        tools: Sequence[Callable | str] | None = None,
        environment_factory=None,
    ):
        from accelerate import Accelerator

        self._created = time.perf_counter()
        self.config = config
        require_eval_set(config, eval_dataset)
        # report_to's trackers; a missing tracker package fails here, before the model loads
        self.accelerator = Accelerator(
            cpu=config.use_cpu or not torch.cuda.is_available(), **accelerator_kwargs(config)
        )
        environment_factory = environment_factory or config.environment_factory
        # Reward functions first: a wrong one fails before the model loads (scorer.resolve_rewards).
        rewards = resolve_rewards(
            config,
            reward_funcs if reward_funcs is not None else config.reward_funcs,
            environment=environment_factory is not None,
        )
        # The same seed on every process: the adapters must start identical (sampling has its own
        # per-process generator, _build_sampler).
        seed_everything(config.seed)
        self._build_model(model, tokenizer)
        # Then each process its own global streams, as TRL does (set_seed(seed, device_specific=True): seed +
        # process index): an environment that draws its tasks, a reward function or a tool that draws with
        # random, and LoRA dropout would otherwise draw alike on every process.
        seed_everything(config.seed + self.accelerator.process_index)
        place_reward_models(rewards, self.accelerator.device, self.model.get_input_embeddings().weight.dtype)
        self.sampler = self._build_sampler(config.tools if tools is None else tools, environment_factory)
        # Each environment class's get_reward is a reward too, weight 1, after the others (as TRL adds them).
        toolbox = self.sampler.toolbox
        environment_rewards = toolbox.environment_rewards() if toolbox is not None else ()
        if not rewards and not environment_rewards:
            raise ValueError(
                "no reward functions: the environment defines no get_reward(); pass reward_funcs=[...] "
                "or set reward_funcs in the config"
            )
        batches = self._build_data([*rewards, *environment_rewards], train_dataset, eval_dataset)
        warmup_restarts = self._build_optimizer(batches)
        # The loop's mutable state, saved and restored whole (state.py).
        self.state = TrainState.for_run(
            config,
            self.accelerator,
            self.total_steps,
            batches,
            warmup_restarts,
            LossScale.for_model(self.model, self.accelerator.device),
        )
        self._build_stages(rewards, environment_rewards)
        if config.metric_for_best_model is not None:
            best.check_metric(config.metric_for_best_model, self.eval_metric_names())
        self.output_dir = Path(config.output_dir)
        self.is_main = self.accelerator.is_main_process
        # named points of the loop call hook(event, trainer, **payload)
        self.hooks: list[Callable[..., None]] = []
        # set by a hook (a callback's should_training_stop): the run ends after this step
        self.stop_requested = False
        self.logging_every = steps_of(config.logging_steps, self.total_steps)
        self.eval_every = steps_of(config.eval_steps, self.total_steps)
        # what a failure mid-run can still checkpoint (run/failures.py)
        self.last_finished = LastFinishedStep()
        # How a stopped run resumes, in the words of its entry point: the Python API's here; the CLI and
        # the TRL front door set theirs.
        self.resume_hint = (
            f"set resume_from_checkpoint='latest' in the GRPOConfig (output_dir={str(self.output_dir)!r}) "
            "and call train() again"
        )
        # What a checkpoint's trainer_state.json holds: transformers' TrainerState of the run, in the meaning of
        # its entry point (the TRL front door gives its own, TRL's log history).
        self.checkpoint_trainer_state: Callable[[], dict[str, Any]] = lambda: (
            self.state.transformers_state_dict()
        )
        # How to train this run on to more steps (max_steps), in the same words.
        self.train_further_hint: Callable[[int], str] = lambda max_steps: (
            f"build a new GRPOTrainer with max_steps={max_steps} and resume_from_checkpoint='latest' in its "
            f"GRPOConfig (output_dir={str(self.output_dir)!r})"
        )
        # hub_model_id: the repository the run pushes to (run/hub.py), made when train() begins (_hub_repo)
        self.hub: HubRepo | None = None
        # a new best at the last step, to be saved as the flow's save by the run's last checkpoint (_end_step); the
        # step whose policy the model holds when not the last (load_best_model_at_end: _best_at_end)
        self.best_due, self.policy_step = False, None

    # ------------------------------------------------------------------ construction
    def _build_model(self, model, tokenizer) -> None:
        """self.model and self.tokenizer: the config's base with its adapters (model/load.py), or the
        caller's model, on this process's device in eval mode (sampling and log-probs run in it)."""
        config = self.config
        # accelerate's mixed_precision is honoured as torch_dtype bfloat16 / float16, or refused by name (device.py)
        config.torch_dtype = mixed_precision_dtype(
            self.accelerator.mixed_precision, config.torch_dtype, self.accelerator.device.type
        )
        if model is None:
            # on this process's device, the CPU too (use_cpu: not a GPU's)
            model, loaded = load_model(config, device_map={"": self.accelerator.device})
            tokenizer = loaded if tokenizer is None else tokenizer  # one given alone is the run's, as TRL's
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        elif not hasattr(model, "peft_config"):
            # a base of the caller's: frozen, its dropout off, and the config's adapters on it, as load_model does
            model = attach_adapters(prepare_base(model), config)
            if config.gradient_checkpointing is True:
                enable_gradient_checkpointing(model)
        elif not {POLICY, REFERENCE} <= set(model.peft_config):
            raise ValueError(
                f"the model is a peft model with the adapters {sorted(model.peft_config)}, not lora_grpo's policy "
                f"({POLICY!r}) and reference slot ({REFERENCE!r}): pass its base model (the config's adapters are "
                "put on it), and to start from a trained adapter, save it and set init_adapter to its directory"
            )
        self.model, self.tokenizer = model, tokenizer
        # also for a model the caller built (see model/load.py)
        keep_4bit_weights_fixed(model)
        # eval mode between updates, where sampling and log-probs run (adapters.train_mode)
        set_training(model, False)
        # moves a plain model; refuses a quantized one on another device
        place_model(model, self.accelerator.device)
        # whether the update's forward (train mode) differs from the no-grad ones by the policy's LoRA dropout
        self.policy_dropout = any(
            isinstance(layer.lora_dropout[POLICY], torch.nn.Dropout) and layer.lora_dropout[POLICY].p > 0
            for _, layer in lora_layers(model, (POLICY,))
        )

    def _build_sampler(self, tools, environment_factory) -> PolicySampler:
        """The rollout stage (sampler.py) on this process's own sampling stream (self.generator), with
        the tools a rollout may call (a multi-turn rollout)."""
        self.generator = torch.Generator(device=self.accelerator.device).manual_seed(
            sampling_seed(self.config.seed, self.accelerator.process_index)
        )
        return PolicySampler(
            self.config,
            self.model,
            self.tokenizer,
            self.generator,
            tools=tools,
            environment_factory=environment_factory,
        )

    def _build_data(self, reward_funcs: list, train_dataset, eval_dataset) -> PromptBatches:
        """self.train_dataset (this process's share) and self.eval_dataset, checked at start-up
        (startup.py: reward columns, every prompt against the context, tokenised once, special tokens,
        the log-probs against the model's own logits); returns the training prompts' batches."""
        config, tokenizer = self.config, self.tokenizer
        self.train_dataset, self.eval_dataset = resolve_datasets(
            config, train_dataset, eval_dataset, tokenizer, self.sampler.prompt_template_kwargs
        )
        self.prompt_lengths = check_datasets(
            reward_funcs,
            {"train_dataset": self.train_dataset, **eval_set_labels(self.eval_dataset)},
            tokenizer,
            self.model,
            config,
        )
        check_special_tokens(self.model, tokenizer)
        check_generation_config(self.model)
        self.log_prob_check = check_model_log_probs(
            self.model, tokenizer, list(self.train_dataset[:2]["prompt"]), config
        )
        return self._prompt_batches()

    def _prompt_batches(self) -> PromptBatches:
        """The run's prompt batches from the first: each process its slice of every batch (data.PromptBatches)."""
        cfg, acc = self.config, self.accelerator
        return PromptBatches(
            self.train_dataset,
            cfg.prompts_per_generation,
            seed=cfg.seed,
            shuffle=cfg.shuffle_dataset,
            num_processes=acc.num_processes,
            process_index=acc.process_index,
        )

    def _build_optimizer(self, batches: PromptBatches) -> WarmupRestarts:
        """The run's length (self.steps_per_epoch, self.total_steps), the policy's parameters, the
        optimizer and the LR schedule; returns the warmup restarts (their state is in the TrainState)."""
        config = self.config
        # Every optimizer update is a step (TRL's count): a rollout feeds num_iterations × steps_per_generation.
        self.steps_per_epoch = batches.steps_per_epoch * config.num_iterations * config.steps_per_generation
        self.total_steps = config.max_steps or math.ceil(config.num_epochs * self.steps_per_epoch)
        self.params = policy_parameters(self.model)
        self.optimizer = build_optimizer(self.params, config)
        # ref_sync_restart_warmup: the warmup restarts at each sync
        warmup_restarts = WarmupRestarts(steps_of(config.warmup_steps, self.total_steps))
        self.scheduler = build_scheduler(
            self.optimizer,
            config,
            self.total_steps,
            warmup_restarts if config.ref_sync_restart_warmup else None,
        )
        return warmup_restarts

    def _build_stages(self, rewards: list, environment_rewards) -> None:
        """The stages that read the run's state, each given what it needs: the update (update.py), the
        sizes (memory/sizes.py), the scorer (scorer.py), the reporter and the evaluator."""
        config, accelerator = self.config, self.accelerator
        # one optimizer update (update.py)
        self.update = PolicyUpdate(
            config,
            self.model,
            self.params,
            self.optimizer,
            self.scheduler,
            accelerator,
            self.state,
            self._event,
        )
        lengths = self.prompt_lengths
        eval_longest = [lengths[label].longest for label in eval_set_labels(self.eval_dataset)]
        self.sizes = RunSizes(
            config,
            self.update,
            accelerator,
            self.state,
            lengths["train_dataset"].longest,
            max(eval_longest) if eval_longest else None,
            side_passes=probe_passes(rewards),
        )
        # A reward model's forwards take the run's rows; reward functions get the run's state as
        # trainer_state and, in a tool run, the sampler's environments.
        self.scorer = RolloutScorer(
            config,
            rewards,
            accelerator,
            self.state,
            environment_rewards=environment_rewards,
            sizes=self.sizes,
            sampler=self.sampler,
        )
        self.reward_funcs, self.reward_names = self.scorer.reward_funcs, self.scorer.names
        self.reporter = RunReporter(config, accelerator, self.reward_names, self.total_steps)
        self.evaluator = Evaluator(
            config,
            accelerator,
            self.reward_names,
            model=self.model,
            sample=self.generate,
            score=lambda rollout, rows, n: self.scorer.rewards(rollout, rows, n)[1],
            log_probs=lambda mb: self.update.forward(mb)[0],
            forward_rows=lambda: self.sizes.forward_rows,
            weights=self.scorer.weights,
        )

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run to total_steps; returns the run summary (also written to summary.json). output_dir is
        claimed for the run (run/run_dir.py: a lock, and no new run over another run's files).

        A trainer trains one run: once it has trained, a second call is refused (RuntimeError, saying
        how to go on) unless it resumes (resume_from_checkpoint set in its config), before output_dir
        is touched. To train further, build a new GRPOTrainer with a higher max_steps and
        resume_from_checkpoint='latest'."""
        if self.state.global_step and not self.config.resume_from_checkpoint:
            raise RuntimeError(
                trained_already(
                    self.state.global_step,
                    self.total_steps,
                    self.output_dir,
                    self.resume_hint,
                    self.train_further_hint,
                )
            )
        self._hub_repo()
        with claim_for_run(self.output_dir, self.config, self.accelerator) as claim:
            for note in claim.notes:
                self._print(note)
            try:
                return self._train()
            except BaseException:
                if self.hub is not None and (line := self.hub.still_uploading()):
                    self._print(line)
                raise

    def _hub_repo(self) -> None:
        """With hub_model_id, the repository the run pushes to, made (or found) on the main process before the run
        begins, so that a missing login stops it before it trains (an eval of the trainer never asks the hub)."""
        cfg = self.config
        if cfg.hub_model_id and self.is_main and self.hub is None:
            self.hub = HubRepo.create(
                cfg.hub_model_id,
                private=cfg.hub_private_repo,
                strategy=cfg.hub_strategy,
                fix="check hub_model_id, or leave it unset to train without pushing",
            )
            self.hub.final_hint = "the final adapter is pushed when the run ends"

    def _train(self) -> dict[str, Any]:
        start = time.perf_counter()
        # before any rollout: the probe is also the preflight
        plan = self.plan_memory()
        self._end_again = False  # resuming into a run's end that failed (_resume_finished)
        if self.config.resume_from_checkpoint and self._resume_finished():
            # (a run whose final push failed pushes now: resuming it is how it says to go on)
            self._push_final()
            return self._summary(start, {}, {})
        self._begin(plan)
        # whatever raises from here on: keep the last finished step, then one error (_step_failed)
        try:
            with stage("eval"):
                eval_before = self._eval_at_start()
            # Stop signals are deferred until the end of the run, final eval and saves included.
            with StopSignals() as stop:
                with self.reporter.progress(self.state.global_step):
                    self._run_steps(stop)
                with stage("eval"):
                    eval_after = self._eval_at_end()
                with stage("checkpoint"):
                    self._save_final()
        except Exception as error:  # noqa: BLE001 - kept, explained and raised again, chained
            self._step_failed(error)
        summary = self._summary(start, eval_before, eval_after)
        if self.is_main:
            # strict JSON: a figure that applies to nothing (NaN) as null, as in metrics.jsonl
            (self.output_dir / "summary.json").write_text(
                json.dumps(plain(summary), indent=2, allow_nan=False) + "\n"
            )
        self.reporter.finish()
        self._event("train_end")
        self._push_final()
        return summary

    def _push_final(self) -> None:
        """With hub_model_id, once the run is complete on disk (a failed push loses nothing): its final adapter with
        config.yaml and the metrics, after the checkpoints' pushes."""
        if self.hub is not None:
            self.hub.wait(say=self._print)
            pushed = self.hub.push_trained(self.output_dir, f"End of training, step {self.state.global_step}")
            self._print(f"pushed {pushed.what} to https://huggingface.co/{self.hub.repo_id}")

    def _resume_finished(self) -> bool:
        """Resume from config.resume_from_checkpoint; True when the checkpoint's run has nothing left
        to train (said in one line; its final adapter written when missing): nothing is trained,
        evaluated or saved again."""
        resumed = self.load_checkpoint(self.config.resume_from_checkpoint)
        self._end_again = self.state.global_step == self.total_steps and self._end_unfinished()
        if self._end_again:
            # The last step's checkpoint, without the end that follows it: the final eval failed (the failure
            # kept the last step), or the process died before summary.json. The end runs now.
            self._print(
                f"{Path(resumed).name} is the run's last step ({self.total_steps}), but the run did not end: no "
                f"summary.json of step {self.total_steps} in {self.output_dir}. Its end runs now: the eval after "
                "training, the final checkpoint and adapter, summary.json"
            )
            return False
        no_adapter = not (self.output_dir / "adapter").exists()
        line = nothing_to_train(
            self.state.global_step, self.total_steps, resumed, no_adapter, further=self.train_further_hint
        )
        if not line:
            return False
        self._print(line)
        if self.config.metric_for_best_model is not None:  # as the run's end did: the best said, or loaded
            self._best_at_end()
        if no_adapter:
            self._save_final_adapter()
        return True

    def _end_unfinished(self) -> bool:
        """Whether output_dir lacks the summary.json of the run's end at this step (the main process reads it;
        every process takes its answer)."""
        unfinished = 0.0
        if self.is_main:
            try:
                summary = json.loads((self.output_dir / "summary.json").read_text())
                unfinished = float(summary.get("steps") != self.state.global_step)
            except (OSError, ValueError, AttributeError):
                unfinished = 1.0
        return sum_over_processes({"unfinished": unfinished}, self.accelerator)["unfinished"] > 0

    def _begin(self, plan: MemoryPlan | None) -> None:
        """The run's start: config.yaml, the logs (truncated or fresh) and trackers, what 'auto' chose,
        the train_begin event; the start is the last finished step."""
        cfg = self.config
        # after the resume checks: a refused or finished resume leaves config.yaml as it was
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.to_yaml(self.output_dir / "config.yaml")
        self.reporter.start(
            self.state.global_step,
            resumed=bool(cfg.resume_from_checkpoint),
            history=self.state.log_history,
            eval_before=self.state.eval_before,
            end_again=self._end_again,
            step_end_again=bool(self.state.unfinished_step),
        )
        if plan is not None:
            self._print(plan.describe(cfg.micro_batch_size == "auto", cfg.gradient_checkpointing == "auto"))
        self.best_due, self.policy_step = False, None
        self.stop_requested = False  # a hook's stop is this run's: one asked in an earlier train() is spent
        self._event("train_begin")
        self._finished_step()

    def _eval_at_start(self) -> dict[str, float]:
        """The eval before training (eval_on_start, a run at step 0 with eval prompts), or {}; a resumed run's is
        the one its checkpoint kept (TrainState.eval_before)."""
        due = self.eval_dataset is not None and self.config.eval_on_start and self.state.global_step == 0
        if due:
            self.state.eval_before = self._evaluate_and_log("before")
        return self.state.eval_before

    def _eval_at_end(self) -> dict[str, float]:
        """The eval after training (eval_on_end, with eval prompts), or {}; it may name the best checkpoint (the
        last, which _save_final writes)."""
        due = self.eval_dataset is not None and self.config.eval_on_end
        metrics = self._evaluate_and_log("after") if due else {}
        if metrics and self.state.global_step > 0:
            self._new_best(metrics)
        return metrics

    def _new_best(self, metrics: dict[str, float]) -> bool:
        """With metric_for_best_model: whether this eval, after a step, is the best so far (run/best.py)."""
        cfg = self.config
        return cfg.metric_for_best_model is not None and best.improved(
            self.state, metrics, cfg.metric_for_best_model, cfg.greater_is_better
        )

    def _save_final(self) -> None:
        """The last checkpoint, the best one said (metric_for_best_model) and the final adapter (output_dir/adapter:
        the best checkpoint's policy with load_best_model_at_end); with hub_model_id and a strategy that pushes whole
        checkpoints, the last checkpoint too (the final adapter reaches the repository's root with the final push)."""
        # a new best at the last step, of the flow's eval: a save the flow asked for (its save event says so)
        target = self.save_checkpoint(due=self.best_due)
        if self.hub is not None and self.hub.pushes_whole_checkpoints:
            self.hub.push_checkpoint(
                target, f"Training in progress, step {self.state.global_step}", root=False
            )
        if self.config.metric_for_best_model is not None:
            self._best_at_end()
        self._save_final_adapter()

    def _best_at_end(self) -> None:
        """The best checkpoint, said in one line. With load_best_model_at_end its policy becomes the model's (on every
        process; policy_step says whose it is), unless its checkpoint is gone or damaged (a warning: the model stays
        the last step's)."""
        state, cfg = self.state, self.config
        if state.best_model_checkpoint is None:
            last = "; the final adapter is the last step's" if cfg.load_best_model_at_end else ""
            if state.best_metric is None:
                what = f"no eval after step 0 gave {cfg.metric_for_best_model} a value, so there is no best checkpoint"
            else:  # a resumed run's best, whose checkpoint was removed
                kept = f"{state.best_metric_name} {state.best_metric:.4g} at step {state.best_global_step}"
                what = f"the best eval ({kept}) has no checkpoint any more"
            self._print(f"metric_for_best_model: {what}{last}")
            return
        if not cfg.load_best_model_at_end:
            self._print(f"the best checkpoint: {best.describe(state)}")
            return
        if state.best_global_step != state.global_step:
            try:
                ckpt.load_adapter_weights(self.model, Path(state.best_model_checkpoint) / POLICY_DIR, POLICY)
            except (ckpt.CheckpointError, OSError) as error:
                warnings.warn(
                    f"load_best_model_at_end: the best checkpoint could not be loaded ({error}); the final adapter "
                    "is the last step's",
                    stacklevel=2,
                )
                return
            self.policy_step = state.best_global_step
            # The slot still holds what the last steps synced into it, not the best step's policy.
            state.reference_is_policy = False
        self._print(f"the final adapter is the best checkpoint's policy: {best.describe(state)}")

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
    ):
        """Push the final adapter (output_dir/adapter/, after train()) with the run's config and metrics to the hub
        repository `repo_id`, created if needed, its model card loading the adapter from there (run/hub.py's
        push_run; `lora-grpo push` from a shell). On the main process; the commit's address, None elsewhere."""
        if not self.is_main:
            return None
        return push_run(self.output_dir, repo_id, token=token, private=private, revision=revision).commit_url

    def _save_final_adapter(self) -> None:
        """output_dir/adapter: the policy as a standard peft adapter, with the tokenizer and its model card."""
        if self.is_main:
            target = self.output_dir / "adapter"
            ckpt.explain_write_failure(
                "the final adapter",
                self.output_dir,
                lambda: ckpt.save_adapter(
                    self.model,
                    target,
                    POLICY,
                    tokenizer=self.tokenizer,
                    card=self.model_card(target),
                ),
            )

    def model_card(
        self,
        where: Path | str,
        *,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags=(),
    ) -> str:
        """The policy adapter's model card as it stands (run/model_card.py), for the directory or Hub id `where`: of
        the steps up to the one whose policy the model holds (policy_step: the best checkpoint's after
        load_best_model_at_end); the dataset by default the config's when it is a hub dataset."""
        config, steps = self.config, self.state.global_step if self.policy_step is None else self.policy_step
        if dataset_name is None and isinstance(config.dataset, str):
            local = config.dataset in LOCAL_DATASETS or Path(config.dataset).expanduser().exists()
            dataset_name = None if local else config.dataset
        return model_card.model_card(
            config,
            steps=steps,
            reward_names=list(self.reward_names),
            syncs=model_card.sync_count(self.state.log_history, steps),
            where=str(where),
            model_name=model_name or self.output_dir.name,
            dataset_name=dataset_name,
            tags=list(tags),
            adapter=self.model.peft_config[POLICY],
        )

    def _run_steps(self, stop: StopSignals) -> None:
        """The optimizer steps, in run order: each step's batch (_step_batches: the rollout, dynamic
        sampling, the steps left of a generation) → the update → the step's count → its end (eval,
        sync, log, checkpoint: _end_step). A step resumed after its eval failed ends first, as it
        would have."""
        state = self.state
        if state.unfinished_step:
            pending, state.unfinished_step = state.unfinished_step, None
            self._end_step(pending["metrics"], epoch_ended=pending["epoch_ended"], stop=stop)
        for step in self._step_batches():
            with stage("update"):
                metrics = {**step.metrics, **self.timed_update(step.batch)}
            self._count_step(metrics, step.epoch)
            self._end_step(metrics, epoch_ended=step.ends_epoch, stop=stop)

    def _step_batches(self) -> Iterator[StepBatch]:
        """The run's optimizer steps until total_steps (or a hook's stop, or, with dynamic sampling in
        a run of num_epochs, the epochs' prompts drawn on any process): each step's batch, the next of
        the current rollout's steps (state.generation), or the first of a new rollout's, sampled and
        scored here (generation_round). Each step begins (the step_begin event) before its rollout;
        the loop runs each step's update and end before asking for the next."""
        cfg, state = self.config, self.state
        while state.global_step < self.total_steps and not self.stop_requested:
            metrics = {}
            if not state.generation:
                if cfg.dynamic_sampling and not cfg.max_steps and self._agreed_prompts_spent():
                    return
                # the data: a row that fails to load or to format
                with stage("rollout"):
                    epoch, rows = next(state.batches)
                # a rollout's first step begins with the rollout
                self._event("step_begin")
                steps, metrics = self.generation_round(rows)
                state.synced_in_generation = False  # its reference log-probs are the slot's as it is
                # after every round of the step: whether drawing its prompts ended an epoch
                state.generation = RolloutSteps(tuple(steps), epoch, self._agreed_epoch_end(epoch))
            else:
                self._event("step_begin")
            # A new RolloutSteps of the rest: what a failure keeps still holds this step.
            batch, state.generation = state.generation.pop()
            rest = state.generation
            yield StepBatch(batch, metrics, rest.epoch, ends_epoch=rest.epoch_ended and not rest)

    def _count_step(self, metrics: dict[str, Any], epoch: int) -> None:
        """An optimizer step done: its time, global_step and the passes over the data."""
        cfg, state = self.config, self.state
        metrics["time/step"] = metrics["time/train"] + (
            metrics.get("time/rollout", 0.0) + metrics.get("time/log_probs", 0.0)
        )
        state.global_step += 1
        # passes over the data: with dynamic sampling, the prompts drawn
        state.epoch = (
            state.batches.epochs_done if cfg.dynamic_sampling else state.global_step / self.steps_per_epoch
        )
        metrics["epoch"] = epoch

    def _summary(self, start: float, before: dict, after: dict) -> dict[str, Any]:
        """summary.json (run/reporting.py), with the best checkpoint under "best" when one was kept (run/best.py)."""
        summary = run_summary(
            self.state.log_history,
            steps=self.state.global_step,
            seconds=time.perf_counter() - start,
            total_seconds=time.perf_counter() - self._created,
            log_prob_check=self.log_prob_check,
            micro_batch_size=self.micro_batch_size,
            gradient_checkpointing=self.gradient_checkpointing,
            memory_plan=self.memory_plan,
            headline=f"eval/{self.reward_names[0]}",
            before=before,
            after=after,
        )
        kept = best.summary(self.state)
        return summary if kept is None else {**summary, "best": kept}

    def _start_again(self) -> None:
        """A new run from the adapters, the optimizer's moments and the loss scale as they are (what TRL's
        second train() does, for the TRL front door): step 0 with a fresh run's loop state (the data from its first
        batch, no history, the schedules at their start, no generation left), the LR schedule from its
        first update. The sampling and torch RNGs go on where they are, as in TRL."""
        cfg = self.config
        batches = self._prompt_batches()
        warmup = WarmupRestarts(steps_of(cfg.warmup_steps, self.total_steps))
        # The loss scale goes on (the same object), as accelerate's GradScaler does in TRL's second train().
        fresh = TrainState.for_run(
            cfg, self.accelerator, self.total_steps, batches, warmup, self.state.loss_scale
        )
        self.state.start_again(fresh)
        self.scheduler.last_epoch = 0
        refresh_lr(self.optimizer, self.scheduler)

    def _finished_step(self) -> None:
        """The state is the last finished step's (the start, or a step end done): what a failure saves."""
        self.last_finished.finished(self.state, self._rng(), self.update.optimizer_steps)

    def _step_failed(self, error: Exception) -> None:
        """Something raised inside the run (run/failures.py): keep what can be kept, then stop with one error
        naming the stage, the step and how to resume, the original error chained. A checkpoint of the last
        finished step when its state is whole (LastFinishedStep), else the last checkpoint. Under several
        processes only for a failure every process raised together (agreed_failures): a checkpoint gathers every
        process's RNG states, a collective that the other processes, waiting in their own, would never join."""
        state, stages = self.state, stages_of(error)
        step, target = self.last_finished.failing_step, None
        saved = self.last_finished.for_failure(stages, self.update.optimizer_steps)
        together = self.accelerator.num_processes == 1 or agreed(error)
        if saved is not None and saved.state["global_step"] > 0 and together:
            state.load_state_dict(saved.state)
            for name, part in saved.process.items():  # the generation's steps as that step left them
                setattr(state, name, part)
            del state.log_history[saved.history :]
            state.unfinished_step = saved.pending
            try:
                target = self.save_checkpoint(rng=saved.rng)
            except (
                OSError
            ) as write_error:  # the disk that failed the step fails this write too: the last checkpoint stays
                self._print(
                    f"the checkpoint of step {state.global_step} could not be written either: {write_error}"
                )
        reward = isinstance(error, RewardFunctionError)
        what = _failure_words(error, stages)
        if any(is_out_of_memory(e) for e in (error, error.__cause__) if e is not None):
            what += f" ({self._out_of_memory_fix()})"
        elif any(
            text in str(e) for e in (error, error.__cause__) if e is not None for text in _NONFINITE_SAMPLING
        ):
            what += f" ({self._nonfinite_logits_fix()})"
        kept = kept_work(
            self.output_dir,
            target,
            self.resume_hint,
            "the function" if reward else "the cause",
            trained=state.global_step > 0,
        )
        # past the last step: the run's end (the eval after training, the final save) failed
        where = f"step {step}/{self.total_steps}" if step <= self.total_steps else "the end of the run"
        message = f"{where} stopped: {what}. {kept}"
        self._print(message)
        if reward:
            raise RewardFunctionError(message, error.function, state.global_step, target) from error
        raise StepFailed(message, stages[-1] if stages else None, state.global_step, target) from error

    def _nonfinite_logits_fix(self) -> str:
        """What to change when the sampler met logits that were inf or NaN."""
        if self.state.loss_scale.enabled:  # the model computes in float16
            return (
                "in float16 the model's activations overflowed ±65504 on this step's "
                "prompts, which the start-up check's did not reach; resume with torch_dtype bfloat16 (on a GPU that "
                "has it) or float32: a resume in float16 meets the same overflow"
            )
        return "its logits were inf or NaN: check the last checkpoint's policy adapter for NaN"

    def _out_of_memory_fix(self) -> str:
        """What to change when a step ran out of memory, with the sizes it ran at."""
        cfg = self.config
        sized = (
            "micro_batch_size auto sized it from a probe at start: free memory others took since, or lower "
            "memory_budget"
            if cfg.micro_batch_size == "auto"
            else f"set micro_batch_size auto (a probe sizes it at start) or lower it (now {cfg.micro_batch_size})"
        )
        return (
            f"out of memory: {sized}; turn gradient_checkpointing on; lower prompts_per_step (now "
            f"{cfg.prompts_per_step}) × num_generations (now {cfg.num_generations}) or max_completion_length (now "
            f"{cfg.max_completion_length}); decode_mode eager keeps no static caches"
        )

    def _end_step(self, metrics: dict[str, Any], *, epoch_ended: bool, stop: StopSignals) -> None:
        """After an optimizer step: eval if due, then the sync decision, log, stop signal, checkpoint, and the
        epoch's end (_end_epoch) when the step ends one. Hooks at "step_end" may change what is due (the TRL
        front door: transformers' flow callbacks)."""
        state = self.state
        step, last = state.global_step, state.global_step >= self.total_steps
        self.last_finished.update_done(state, self._rng(), self.update.optimizer_steps, metrics, epoch_ended)
        due = StepFlow(
            evaluate=self.eval_dataset is not None
            and bool(self.eval_every)
            and step % self.eval_every == 0
            and not last,
            log=step % self.logging_every == 0 or last,
            save=bool(self.config.save_steps) and step % self.config.save_steps == 0 and not last,
        )
        self._event("step_end", flow=due)
        # Eval before the sync decision, so that the plateau trigger reads this step's eval. For every
        # other trigger the order is free: eval reads only the policy and the start (base_forward), a
        # sync writes only the reference slot and the optimizer.
        new_best, evaluated = False, due.evaluate
        if due.evaluate:
            with stage("eval"):
                metrics.update(self.evaluate())
            state.sync_schedule.observe_eval(headline_score(metrics, self.reward_names))
            new_best = self._new_best(metrics)
        # the KL to the reference as the slot is: not after a sync inside this rollout (its steps left measure
        # the reference before it, and would fire the trigger at each of them)
        kl = None if state.synced_in_generation else metrics.get("kl")
        reason = state.sync_schedule.due(step, epoch_ended=epoch_ended, kl=kl)
        if reason:
            # a sync changes the reference slot, which the state before it cannot describe: from here until the
            # step is done a failure keeps the last checkpoint. Without one, a failure in the log, an eval a hook
            # asked for or the epoch's end is saved as this step with its end pending (its records dropped), as
            # a failing eval is
            self.last_finished.changing()
            with stage("sync"):
                metrics.update(self.sync_reference())
            state.synced_in_generation = True
            metrics["sync/event"] = 1.0
            metrics["sync/reason"] = reason
        with stage("log"):
            # health/* flags go into this step's metrics (run/health.py)
            for line in state.health.observe(step, metrics, self.config.max_completion_length):
                self._print(line)
            state.log_history.append(metrics)
            # a rollout's first optimizer step: its completions are logged once
            first = "time/rollout" in metrics
            self.reporter.log_step(step, metrics, self.scorer.last_samples if first else None, show=due.log)
            if due.log:
                self._print(progress_line(step, self.total_steps, metrics))
                self._event("log", logs=metrics)
        if due.evaluate and not evaluated and not last and self.eval_dataset is not None:
            # asked for by a hook at the log (a TRL callback's on_log): after it, as transformers evaluates
            with stage("eval"):
                new_best = self._new_best(self._evaluate_at_step())
        # a new best is kept: its checkpoint is written now, or at the last step as the run's last (_save_final)
        self.best_due = self.best_due or (new_best and last)
        saved = due.save or (new_best and not last)
        if saved:
            with stage("checkpoint"):
                self.save_checkpoint(due=True)
        if epoch_ended or last or self.stop_requested:
            # (its eval and callbacks come after the step's save: only a save of its own holds them)
            saved = self._end_epoch(metrics)
        # a stop signal once the step has ended whole, its epoch's end included (stopped before it, the resumed run
        # began after the step and never ended that epoch: its eval, save and epoch_end callbacks were lost)
        signum = agreed_signal(stop.received, self.accelerator.num_processes, self.accelerator.device)
        if signum:
            self._stop(signum, saved)
        self._finished_step()

    def _end_epoch(self, metrics: dict[str, Any]) -> bool:
        """The epoch_end event, where transformers ends an epoch: at an epoch's last step, and at the run's last
        step or a hook's stop inside one. A hook may ask for a log, an eval or a checkpoint there (the TRL front
        door: the epoch strategies, a callback's control), done in transformers' order. Whether it wrote a
        checkpoint."""
        then = StepFlow(evaluate=False, log=False, save=False)
        self._event("epoch_end", flow=then)
        if then.log:
            self._event("log", logs=metrics)
        new_best = False
        if then.evaluate and self.eval_dataset is not None:
            with stage("eval"):
                new_best = self._new_best(self._evaluate_at_step())
        last = self.state.global_step >= self.total_steps
        self.best_due = self.best_due or (new_best and last)
        if then.save or (new_best and not last):
            with stage("checkpoint"):
                self.save_checkpoint(due=True)
            return True
        return False

    def generation_round(self, rows: dict[str, list]) -> tuple[list[Batch], dict[str, float]]:
        """One rollout of the round's prompts, scored, ready for its optimizer steps: (the step batches in
        training order, num_iterations passes over steps_per_generation slices; the round's metrics).
        With dynamic_sampling, more rollouts of the next prompts until enough groups carry signal
        (sample_step); the batches hold those groups."""
        cfg, device = self.config, self.accelerator.device
        t0 = now(device)
        rows, rollout, scored, sampled, sampling_metrics = self._sample_and_score(rows)
        t_gen = now(device)
        # rewards → group-relative advantages
        with stage("reward"):
            advantages, metrics = self.scorer.advantages(rollout, rows, scored, sampled)
        metrics.update(sampling_metrics)
        batch = Batch.from_rollout(
            rollout, advantages, mask_truncated_completions=cfg.mask_truncated_completions
        )
        # the log-probs the update needs (forwards that may run out of memory on one process)
        with stage("update"), agreed_failures(self.accelerator):
            self._add_log_probs(batch)
        metrics["reference_reused_policy"] = float(cfg.beta != 0 and self.state.reference_is_policy)
        if cfg.steps_per_generation > 1:
            # each step a random share of the rollout, as TRL shuffles before cutting
            order = torch.Generator().manual_seed(shuffle_seed(cfg.seed, self.state.global_step))
            batch = batch.rows(
                torch.randperm(batch.input_ids.shape[0], generator=order).to(batch.input_ids.device)
            )
        t_ref = now(device)
        tokens, seconds = float(rollout.completion_mask.sum()), t_ref - t0
        if self.accelerator.num_processes > 1:
            # the run's throughput: every process's tokens over the slowest process's seconds
            each = self.accelerator.gather(torch.tensor([[tokens, seconds]], device=device))
            tokens, seconds = each[:, 0].sum().item(), each[:, 1].max().item()
        metrics.update(
            {
                "time/rollout": t_gen - t0,
                "time/log_probs": t_ref - t_gen,
                "tokens_per_second": tokens / seconds,
            }
        )
        # where a rollout is cut into steps
        return batch.steps(cfg.steps_per_generation) * cfg.num_iterations, metrics

    def _sample_and_score(self, rows: dict[str, list]) -> tuple:
        """The round's rollout and its rewards; with dynamic_sampling, more rounds until the step holds
        enough informative groups. (rows, rollout, scored: what is trained on; sampled: None, or with
        dynamic sampling (every completion the step sampled, their Scored, the trained rows of them);
        dynamic sampling's metrics over every process)."""
        cfg = self.config
        # the processes' own code (the model's sampling, tools, environments, reward functions), before the step's
        # first collective
        with agreed_failures(self.accelerator):
            with stage("rollout"):
                rollout = self.generate(rows["prompt"], rows=rows)
            with stage("reward"):
                scored = self.scorer.score(rollout, rows, cfg.num_generations)
            if cfg.dynamic_sampling:
                step = self.sample_step(Round(rows, rollout, scored))
        if not cfg.dynamic_sampling:
            return rows, rollout, scored, None, {}
        rows, rollout, scored = step.trained(self.reward_names)
        counts = sum_over_processes(step.counts, self.accelerator)
        sampled = (step.rollout, step.scored, step.trained_rows)
        return rows, rollout, scored, sampled, step_metrics(counts, self.accelerator.num_processes)

    def _add_log_probs(self, batch: Batch) -> None:
        """The batch's old log-probs when it is trained on after its first update (num_iterations or
        steps_per_generation > 1), and its reference log-probs when beta != 0. A reference slot that
        provably equals the policy (a fresh or warm-started run before its first update, right after
        a hard sync) costs no forward: the update uses the policy's own."""
        cfg = self.config
        if cfg.num_iterations > 1 or cfg.steps_per_generation > 1:
            batch.old_logp = self.log_probs(batch)
        if cfg.beta != 0 and not self.state.reference_is_policy:
            with reference_forward(self.model):
                batch.ref_logp = self.log_probs(batch)
        elif cfg.beta != 0 and self.policy_dropout:
            # The reference equals the policy, but the update's forward drops LoRA inputs (lora_dropout): its own
            # log-probs would make the KL and its gradient 0. The policy's without dropout are the reference's.
            batch.ref_logp = batch.old_logp if batch.old_logp is not None else self.log_probs(batch)

    def sample_step(self, first: Round) -> StepSample:
        """Dynamic sampling (dynamic_sampling.py): after `first`, rounds of the next prompts until the
        step holds prompts_per_generation informative groups, or the rounds or the prompts run out."""
        cfg, scorer = self.config, self.scorer

        def next_round() -> Round | None:
            if self._prompts_spent():
                return None
            with stage("rollout"):
                _, rows = next(self.state.batches)
                rollout = self.generate(rows["prompt"], rows=rows)
            with stage("reward"):
                return Round(rows, rollout, scorer.score(rollout, rows, cfg.num_generations))

        G = cfg.num_generations
        return sample_step(
            first,
            next_round,
            group_size=G,
            quota=cfg.prompts_per_generation,
            max_rounds=cfg.dynamic_sampling_max_rounds,
            informative=lambda scored: informative_groups(
                scored.per_func,
                scorer.weights,
                G,
                cfg.multi_objective_aggregation,
                cfg.dynamic_sampling_min_std,
            ),
            classify=lambda scored, dropped: dropped_kinds(
                scored.per_func[:, 0], dropped, G, cfg.eval_correct_threshold
            ),
            pad_token_id=self.tokenizer.pad_token_id,
            names=self.reward_names,
        )

    def _prompts_spent(self) -> bool:
        """Whether a run of num_epochs (max_steps 0) has drawn its epochs' prompts: with dynamic sampling
        a step may draw several batches, so the epochs, not the step count, end the run."""
        cfg = self.config
        return not cfg.max_steps and self.state.batches.epochs_done >= cfg.num_epochs

    def _agreed_epoch_end(self, epoch: int) -> bool:
        """Whether drawing this step's prompts ended epoch `epoch`. With dynamic sampling each process draws its own
        rounds, at its own pace, so one may end an epoch a step before another: it ends on every process when it
        ends on any, so that the epoch's sync (ref_sync_every_epoch) and its eval or checkpoint (the TRL front
        door's epoch strategies, whose collectives every process must reach) happen at one step everywhere."""
        ended = self.state.batches.epoch != epoch
        if not self.config.dynamic_sampling:
            return ended  # every process draws one batch a step: their epochs end together
        return sum_over_processes({"ended": float(ended)}, self.accelerator)["ended"] > 0

    def _agreed_prompts_spent(self) -> bool:
        """_prompts_spent on any process (each draws its own share, at its own pace): every process
        ends the run at the same step."""
        spent = {"spent": float(self._prompts_spent())}
        return sum_over_processes(spent, self.accelerator)["spent"] > 0

    def training_step(self, rows: dict[str, list]) -> dict[str, float]:
        """One generation round on one batch of prompts and all its optimizer steps (one, at the defaults);
        returns the round's metrics with the last step's. train() runs the same stages."""
        steps, metrics = self.generation_round(rows)
        for step_batch in steps:
            metrics.update(self.timed_update(step_batch))
        return metrics

    def timed_update(self, batch: Batch) -> dict[str, float]:
        """One optimizer update (update.PolicyUpdate) with its time."""
        t0 = now(self.accelerator.device)
        metrics = self.optimize(batch)
        metrics["time/train"] = now(self.accelerator.device) - t0
        return metrics

    # ------------------------------------------------------------------ stages
    def generate(
        self,
        prompts: list[str],
        num_generations: int | None = None,
        temperature: float | None = None,
        generator: torch.Generator | None = None,
        rows: dict[str, list] | None = None,
    ) -> Rollout:
        """Sample with the policy (sampler.PolicySampler); `generator` defaults to the training sampling stream."""
        return self.sampler.sample(prompts, num_generations, temperature, generator, rows)

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
        """eval/* metrics of the policy (evaluation.Evaluator) on `dataset`: the run's eval prompts by
        default, or any dataset source the run takes (rendered and checked as its own are), or a dict
        of named sets, each evaluated on its own (eval/<name>/* metrics). Each set's result is also
        the payload of an "evaluate" event (metrics=, set_name=, seconds=, rows=)."""
        sets = named_eval_sets(self.eval_dataset if dataset is None else self._resolve_eval(dataset))
        if not sets:
            raise ValueError(
                "evaluate: this run has no eval prompts; pass evaluate(dataset) or set eval_dataset"
            )
        metrics = {}
        for name, rows in sets.items():
            start = time.perf_counter()
            found = self.evaluator.evaluate(rows, batch_prompts)
            self._event(
                "evaluate", metrics=found, set_name=name, seconds=time.perf_counter() - start, rows=len(rows)
            )
            metrics.update(
                found
                if name is None
                else {f"eval/{name}/{k.removeprefix('eval/')}": v for k, v in found.items()}
            )
        return metrics

    def eval_metric_names(self) -> list[str]:
        """The eval/* metrics evaluate() returns on the run's eval prompts (eval/<set>/... for named sets)."""
        toolbox = self.sampler.toolbox
        names = metric_names(self.reward_names, self.config, tools=toolbox is not None and toolbox.has_tools)
        return [
            name if set_name is None else f"eval/{set_name}/{name.removeprefix('eval/')}"
            for set_name in named_eval_sets(self.eval_dataset)
            for name in names
        ]

    def _resolve_eval(self, source):
        """An eval source passed to evaluate(): rendered with the run's template and checked against
        the rewards and the context, as the run's own eval prompts were."""
        resolved = resolve_eval_dataset(
            source, self.config, self.tokenizer, self.sampler.prompt_template_kwargs
        )
        check_datasets(self.reward_funcs, eval_set_labels(resolved), self.tokenizer, self.model, self.config)
        return resolved

    def _evaluate_at_step(self) -> dict[str, float]:
        """An eval outside a step's own record (before or after training, or one a hook asked for at a step's log
        or an epoch's end: the TRL front door's epoch strategy, a callback's should_evaluate): into
        metrics.jsonl and the trackers at the current step, as every eval."""
        metrics = self.evaluate()
        self.reporter.log({"step": self.state.global_step, **metrics})
        return metrics

    def _evaluate_and_log(self, when: str) -> dict[str, float]:
        """The eval before or after training: printed, logged at the current step; 'before' feeds
        the plateau trigger."""
        metrics = self._evaluate_at_step()
        self._print(f"eval {when} training: {format_metrics(metrics)}")
        if when == "before":
            self.state.sync_schedule.observe_eval(headline_score(metrics, self.reward_names))
        return metrics

    # ------------------------------------------------------------------ sizes (memory/sizes.py)
    def plan_memory(self) -> MemoryPlan | None:
        """The 'auto' sizes and the memory preflight (memory/probe.py), once; None when both are fixed."""
        return self.sizes.make_plan()

    @property
    def memory_plan(self) -> MemoryPlan | None:
        return self.sizes.plan

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward: the config's, or the memory plan's for 'auto' (planned on first use)."""
        return self.sizes.micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int) -> None:
        self.state.micro_batch_size = value

    @property
    def gradient_checkpointing(self) -> bool:
        return self.sizes.gradient_checkpointing

    # ------------------------------------------------------------------ checkpoints
    def _rng(self) -> dict[str, Any]:
        return {**rng_state(), "sampling": self.generator.get_state()}

    def save_checkpoint(self, rng: dict[str, Any] | None = None, *, due: bool = False) -> Path:
        """output_dir/checkpoint-{step}: both adapters, optimizer, scheduler, every process's RNG
        states, and the TrainState whole (each process's steps left of its generation included).
        Atomic (run/checkpoint.py). Called on every process: each one's RNG states and own state are
        gathered; the main process writes; every process returns its path. `rng`: this process's states to save
        instead of the current ones (those of the last finished step, after a failure). `due`: a save the
        step's flow asked for (save_steps, a hook), not the run's last, a failure's or a stop's (the save
        event's payload)."""
        from accelerate.utils import gather_object

        target = self.output_dir / f"checkpoint-{self.state.global_step}"
        best.saved(self.state, target)
        mine = (rng or self._rng(), self.state.process_state_dict())
        gathered = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        if self.is_main:
            blobs = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": [rng for rng, _ in gathered],
                "process_state": [process for _, process in gathered],
            }
            state, trainer_state = self.state.state_dict(), self.checkpoint_trainer_state()
            ckpt.explain_write_failure(
                f"checkpoint {target.name}",
                self.output_dir,
                lambda: ckpt.save_checkpoint(
                    target,
                    self.model,
                    blobs=blobs,
                    state=state,
                    trainer_state=trainer_state,
                    config_yaml=self.config.to_yaml(),
                    tokenizer=self.tokenizer,
                    card=self.model_card(target),
                ),
            )
            if self.config.save_total_limit:  # 0: keep them all, the best among them
                ckpt.rotate_checkpoints(
                    self.output_dir, self.config.save_total_limit, protect=self.state.best_model_checkpoint
                )
            self.reporter.plot()  # metrics.png so far (a failure is only a warning)
        self.accelerator.wait_for_everyone()
        if due and self.hub is not None and self.hub.wants():  # hub_model_id: in the background
            self.hub.push_checkpoint(target, f"Training in progress, step {self.state.global_step}")
        self._event("save", due=due, path=target)
        return target

    def load_checkpoint(self, path: str | Path) -> Path:
        """Resume from a checkpoint dir, or 'latest' in output_dir; clear errors for anything else."""
        path = ckpt.resolve_checkpoint(path, self.output_dir)
        self.plan_memory()  # the sizes this start can use (a checkpoint's 'auto' sizes are taken when they fit)
        state, current = self.state, (self.state.micro_batch_size, self.state.gradient_checkpointing)
        saved = ckpt.restore_training_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=state,
            generator=self.generator,
            config_values=self.config.to_dict(),
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            device=self.accelerator.device,
        )
        # after the warmup state
        saved_lr = apply_optimizer_config(self.optimizer, self.scheduler, self.config)
        if saved_lr != self.config.learning_rate:
            self._print(
                f"learning_rate {saved_lr:g} in the checkpoint, {self.config.learning_rate:g} in this config: "
                f"using {self.config.learning_rate:g}"
            )
        line = self.sizes.resume(current, saved)
        if line:
            self._print(line)
        line = best.resumed(state, self.output_dir, self.config.metric_for_best_model)
        if line:
            self._print(line)
        if self.is_main:
            for moved in ckpt.set_aside_later_checkpoints(self.output_dir, state.global_step):
                self._print(
                    f"{moved.name}: a later checkpoint of the run this one resumes, set aside (not deleted)"
                )
        left = len(state.generation) if state.generation else 0
        inside = (
            f", inside a generation: its {left} step(s) left train on the checkpoint's rollout"
            if left
            else ""
        )
        self._print(f"resumed from {path} at step {state.global_step}{inside}")
        return path

    def _stop(self, signum: int, saved: bool = False) -> None:
        """After a stop signal: write a checkpoint (unless the step's end just wrote this step's: `saved`), then
        raise TrainingInterrupted with how to resume."""
        target = self.output_dir / f"checkpoint-{self.state.global_step}"
        if not saved:
            with stage("checkpoint"):
                target = self.save_checkpoint()
        name = signal.Signals(signum).name
        message = (
            f"{name}: stopped after step {self.state.global_step}/{self.total_steps}; checkpoint written to "
            f"{target}. Resume: {self.resume_hint}"
        )
        self._print(message)
        raise TrainingInterrupted(message, signum, target)

    # ------------------------------------------------------------------ plumbing
    def _event(self, name: str, **payload) -> None:
        """A named point of the loop: train_begin, step_begin, pre_optimizer_step and optimizer_step (around the
        optimizer's step, skipped or not), step_end (flow=StepFlow), log (logs=), evaluate (metrics=), save (due=,
        path=: the checkpoint written), epoch_end (flow=StepFlow: after the step that ends an epoch, the run or a
        hook's stop; _end_epoch), train_end. Callbacks hang here: hook(name, trainer, **payload) (the TRL front door
        dispatches to transformers' CallbackHandler)."""
        for hook in self.hooks:
            hook(name, self, **payload)

    def _print(self, text: str) -> None:
        self.reporter.print(text)  # through the progress bar (tqdm.write), main process only


def _failure_words(error: Exception, stages: tuple[str, ...]) -> str:
    """A stopped step's error in its message's words: a reward function's error says itself which function and
    sample, any other its stage, type and text; another process's (PeerFailed) the same, after that process."""
    if isinstance(error, PeerFailed):
        said, kind, text = f"process {error.process} stopped: ", error.error_type, error.error_text
    else:
        said, kind, text = "", type(error).__name__, str(error)
    if kind == RewardFunctionError.__name__:
        return said + text
    return f"{said}{describe_stages(stages)} raised {kind}: {text}"
