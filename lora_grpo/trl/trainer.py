"""TRL's GRPOTrainer, as a translation onto lora_grpo's trainer (which does all the work).

    TRL's constructor ─► translate.to_native (the config) + the model (a name, a loaded model, a
        PeftModel; peft_config's LoRA; quantization_config) ─► lora_grpo.trainer.GRPOTrainer
    its loop's named points (trainer._event) ─► transformers' CallbackHandler: DefaultFlowCallback
        decides when to log, evaluate and save from the TrainingArguments, the user's callbacks run
    its per-step records ─► TRL's metric names, averaged over each logging window (as TRL's log())
    push_to_hub ─► run/hub.py: the repository made when built, each save step's checkpoint pushed in the
        background by hub_strategy, output_dir pushed by save_model() and push_to_hub()

`trainer.state` is a transformers TrainerState of TRL's meaning (global_step counts every optimizer
update, log_history holds TRL-named records); the native loop's own state is `trainer.native.state`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils.memory import clear_device_cache
from transformers import DefaultFlowCallback, TrainerControl, TrainerState, trainer_pt_utils
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import TrainOutput

from ..algo.loss import high_entropy_mask, off_policy_mask, padded_gather
from ..config import ConfigError
from ..model.adapters import POLICY
from ..model.bases import resolve_base
from ..rewards import RewardModel
from ..rng import seed_everything
from ..run import model_card
from ..run.best import UnknownMetric
from ..run.checkpoint import save_adapter
from ..run.failures import StepFailed
from ..run.hub import HubRepo
from ..run.owned_dir import protected_paths, write_into, write_whole
from ..run.reporting import table_of, tracker_names
from ..run.run_dir import not_a_runs
from ..trainer import GRPOTrainer as NativeTrainer
from .checks import refuse_as_trl, warn_as_trl
from .config import EXTENSIONS, GRPOConfig
from .inputs import environment_prompts, eval_sets, placeholder_prompts
from .models import build_model, reward_models
from .overrides import refuse_loop_overrides
from .translate import FIELDS, _as_dict, resolved_steps, stand_ins, to_native, unknown_metric

logger = logging.getLogger(__name__)

_NO_LOADER = "lora_grpo has no DataLoader: its loop draws the prompts of trainer.train_dataset itself"
_OWN_LOOP = "lora_grpo's loop computes the GRPO loss itself (lora_grpo.algo.loss); a subclass overriding it is refused"
# transformers' Trainer methods lora_grpo.trl lacks, with what to use (GRPOTrainer.__getattr__)
NOT_HERE = {
    "get_train_dataloader": _NO_LOADER,
    "get_eval_dataloader": _NO_LOADER + "; evaluate() reads the eval prompts",
    "get_test_dataloader": _NO_LOADER + "; evaluate(eval_dataset=...) reads any prompts",
    "create_optimizer": "the optimizer is built with the trainer: trainer.optimizer (GRPOConfig's optim)",
    "create_scheduler": "the schedule is built with the trainer: trainer.lr_scheduler (GRPOConfig's lr_scheduler_type)",
    "create_optimizer_and_scheduler": "both are built with the trainer: trainer.optimizer, trainer.lr_scheduler",
    "compute_loss": _OWN_LOOP,
    "training_step": _OWN_LOOP,
    "prediction_step": _OWN_LOOP,
    "predict": "use trainer.evaluate(eval_dataset=...): greedy completions scored by the reward functions",
    "hyperparameter_search": "build one GRPOTrainer per trial",
}

# TRL 1.16's GRPOTrainer attributes that are its arguments as given (grpo_trainer.py's __init__)
TRL_ARGUMENT_ATTRIBUTES = (
    "max_completion_length",
    "num_generations",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "pad_to_multiple_of",
    "use_vllm",
    "vllm_mode",
    "loss_type",
    "multi_objective_aggregation",
    "scale_rewards",
    "importance_sampling_level",
    "off_policy_mask_threshold",
    "mask_truncated_completions",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "num_iterations",
    "beta",
    "log_completions",
    "num_completions_to_print",
)

# Our metric names → TRL 1.16's; others (sync/*, time/*, ...) are logged under our names beside them.
TRL_NAMES = {
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "completion_length/mean": "completions/mean_length",
    "completion_length/max": "completions/max_length",
    "completion_length/min": "completions/min_length",
    "completion_length/terminated_mean": "completions/mean_terminated_length",
    "completion_length/terminated_min": "completions/min_terminated_length",
    "completion_length/terminated_max": "completions/max_terminated_length",
    "truncated_fraction": "completions/clipped_ratio",
    "clip_ratio/low": "clip_ratio/low_mean",
    "clip_ratio/high": "clip_ratio/high_mean",
    "clip_ratio/region": "clip_ratio/region_mean",
    "lr": "learning_rate",
    "time/step": "step_time",
}
# transformers and TRL log the latest of these, not a window mean (loss_scale, a float16 run's, is ours)
_LAST = (
    "learning_rate",
    "grad_norm",
    "epoch",
    "num_tokens",
    "loss_scale",
)


def _not_assignable(name: str, instead: str) -> None:
    raise AttributeError(
        f"trainer.{name} = ...: lora_grpo builds the run's {name} when the GRPOTrainer is built, and TRL's next "
        f"train() would read the new one; here it would not act: {instead}"
    )


def _same(now, before) -> bool:
    """Whether a GRPOConfig value is unchanged (an enum as its value; a value that does not compare as a bool is
    unchanged only if it is the same object)."""
    try:
        return bool(getattr(now, "value", now) == getattr(before, "value", before))
    except Exception:  # noqa: BLE001 - an array-like's comparison
        return now is before


def trl_record(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """One TRL log record from the native per-step records of a logging window: every numeric metric
    averaged over the steps that have it, renamed to TRL's names. As TRL's log(), NaN is left out, and a
    metric that is NaN at every step (a reward function that returned None for all) is None."""
    out: dict[str, float | None] = {}
    keys = dict.fromkeys(k for r in records for k in r)
    for key in keys:
        numbers = [
            r[key]
            for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
        ]
        values = [v for v in numbers if not (isinstance(v, float) and math.isnan(v))]
        if not numbers or key in ("step", "epoch") or key.startswith("eval/"):
            continue
        name = TRL_NAMES.get(key, key)
        out[name] = None if not values else values[-1] if name in _LAST else sum(values) / len(values)
    return out


def as_trl_raises(failed: StepFailed) -> BaseException:
    """What TRL raises where lora_grpo's run stopped with `failed` (a step's stage raised; the last finished step
    kept): the error the step raised, as it was (an `except` for its type catches it), with failed's message (the
    step, what was kept, how to resume) as a note. `failed` itself where lora_grpo raised first (a reward
    function's values that break the contract)."""
    error = failed.__cause__
    while isinstance(error, StepFailed):
        error = error.__cause__
    if error is None:
        return failed
    try:
        error.add_note(f"lora_grpo: {failed}")
    except (AttributeError, TypeError):  # an exception that takes no attributes goes on without the note
        pass
    return error


class GRPOTrainer:
    """TRL 1.16's GRPOTrainer signature and step counting on lora_grpo's trainer.

    ``from lora_grpo.trl import GRPOConfig, GRPOTrainer`` in place of ``from trl import ...``: the
    arguments are TRL's, translated onto one ``lora_grpo.GRPOConfig`` (``lora_grpo.trl.FIELDS`` says
    what becomes of each field), and the run is lora_grpo's: the reference slot (``sync_ref_model``
    works with a ``peft_config``), the exact weight-space mix and the start-up memory plan.

    Args:
        model: a hub id or path, a loaded ``PreTrainedModel`` (also in 4-bit), or a ``PeftModel``
            whose adapter becomes the warm-start policy and the initial reference.
        reward_funcs: reward functions (TRL's contract), reward-model ids or loaded models.
        args: TRL's ``GRPOConfig``; None: TRL's defaults with ``output_dir="<model name>-GRPO"``.
        train_dataset: the training prompts.
        eval_dataset: held-out prompts for ``evaluate()``.
        processing_class: the tokenizer; None: the model's.
        reward_processing_classes: the reward models' tokenizers, in ``reward_funcs``'s order.
        callbacks: transformers ``TrainerCallback``s, run by its ``CallbackHandler``.
        optimizers: refused unless ``(None, None)``: lora_grpo builds the LoRA policy's AdamW.
        quantization_config: a ``BitsAndBytesConfig`` for a model given by name.
        peft_config: a ``LoraConfig``; None trains a LoRA adapter (r 16, alpha 32, every linear layer).
        tools: functions the policy may call in a rollout.
        rollout_func: refused: lora_grpo samples with its own sampler.
        environment_factory: a class whose public methods are the tools.

    Example:
        >>> from lora_grpo.trl import GRPOConfig, GRPOTrainer
        >>> args = GRPOConfig(output_dir="runs/trl", beta=0.04, sync_ref_model=True, ref_model_sync_steps=64)
        >>> trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=accuracy_reward,  # doctest: +SKIP
        ...                       args=args, train_dataset=dataset)
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        # a subclass that overrides TRL's loop methods (its override would never run here)
        refuse_loop_overrides(type(self), GRPOTrainer)
        if optimizers != (None, None) and any(o is not None for o in optimizers):
            raise ConfigError(
                "optimizers=(...): lora_grpo builds the AdamW of the LoRA policy itself; set optim, "
                "learning_rate, lr_scheduler_type and warmup_steps in GRPOConfig instead"
            )
        if rollout_func is not None:
            raise ConfigError(
                "rollout_func: lora_grpo samples with its own sampler (tools=[...] for tool calls)"
            )
        name = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", "model")
        )
        if args is None:
            args = GRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        self.args = args
        refuse_as_trl(
            args,
            model=model,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            environment_factory=environment_factory,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        warn_as_trl(args, model=model, quantization_config=quantization_config)
        for note in stand_ins(args):
            logger.warning(note)
        # As TRL (transformers' set_seed before the model is built): the seed decides the LoRA initialisation.
        seed_everything(args.seed)
        if isinstance(model, str):
            # The offline toy bases and packaged models by name, as the native recipes take them; a GGUF
            # file (or model_init_kwargs' gguf_file, as from_pretrained takes it) converted once.
            init_kwargs = _as_dict(args.model_init_kwargs, "model_init_kwargs")
            model = resolve_base(model, init_kwargs.get("gguf_file"), revision=init_kwargs.get("revision"))
        # what save_model never writes over (with the config's paths): the base as loaded
        self._base_path = model if isinstance(model, str) else None
        # the environment owns the data; its reset() supplies each prompt (TRL)
        if train_dataset is None:
            train_dataset = placeholder_prompts(args.generation_batch_size, args.num_generations)
        eval_dataset = eval_sets(eval_dataset)
        if environment_factory is not None:
            train_dataset = environment_prompts(train_dataset)
            eval_dataset = environment_prompts(eval_dataset)
        world = getattr(args, "world_size", 1) or 1
        set_names = (
            None if eval_dataset is None else list(eval_dataset) if isinstance(eval_dataset, dict) else []
        )
        model_fields, build = build_model(model, args, quantization_config, peft_config, processing_class)
        config = to_native(
            args,
            model_name_or_path=str(name),
            world_size=world,
            eval_set_names=set_names,
            # what fills an unset top_k / min_p, as in TRL's generate: the model's generation_config
            generation_defaults=getattr(model, "generation_config", None) or model,
            **model_fields,
        )
        peft_model, tokenizer = build(config)
        funcs = reward_models(
            reward_funcs,
            reward_processing_classes,
            config.chat_template_kwargs,
            # as TRL loads a reward model named by a string: the policy's model_init_kwargs, trust_remote_code's default
            {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})},
        )
        extra = {} if tools is None else {"tools": tools}
        if environment_factory is not None:
            extra["environment_factory"] = environment_factory
        try:
            self.native = NativeTrainer(
                config,
                reward_funcs=funcs,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                model=peft_model,
                tokenizer=tokenizer,
                **extra,
            )
        except UnknownMetric as error:  # in transformers' sentence and the front door's names
            message = unknown_metric(args.metric_for_best_model, error.known, set_names or ())
            raise ConfigError(message, field="metric_for_best_model") from None
        self.model, self.processing_class = self.native.model, tokenizer
        # transformers' Trainer's model_wrapped (TRL's LogCompletionsCallback generates with it): no DDP or DeepSpeed
        # wrapper here, so the model itself, as transformers sets it for an unwrapped model
        self.model_wrapped = self.model
        self.accelerator = self.native.accelerator
        self.is_deepspeed_enabled = self.is_fsdp_enabled = False
        # TRL's public attributes: no separate reference model with PEFT (the reference slot is an adapter of
        # self.model); reward models as the loaded models, with their tokenizers; names as TRL logs them.
        self.ref_model = None
        self.reward_funcs = [f.model if isinstance(f, RewardModel) else f for f in self.native.reward_funcs]
        self.reward_processing_classes = [
            f.tokenizer if isinstance(f, RewardModel) else None for f in self.native.reward_funcs
        ]
        self.reward_func_names = list(self.native.reward_names)
        self._copy_trl_arguments(args)
        self.state = self._new_state()
        self.control = TrainerControl()
        # as transformers' Trainer: the flow, the trackers report_to names (TRL's records, at its logging steps),
        # then the script's own
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to), *(callbacks or [])],
            self.model,
            tokenizer,
            self.native.optimizer,
            self.native.scheduler,
        )
        self.native.hooks.append(self._on_event)
        if args.log_completions:
            self.native.reporter.completion_listeners.append(self._completions_table)
        self.native.resume_hint = (
            "trainer.train(resume_from_checkpoint=True)"  # TRL's words, with the same args
        )
        self.native.train_further_hint = lambda max_steps: (
            f"set max_steps={max_steps} in GRPOConfig, build the GRPOTrainer again with it and call "
            "trainer.train(resume_from_checkpoint=True)"
        )
        self.native.scorer.trainer_state = self.state  # reward functions see TRL's TrainerState, as in TRL
        self.native.checkpoint_trainer_state = self._checkpoint_state  # trainer_state.json: TRL's, as in TRL
        self._logged_upto = 0  # native records already averaged into a TRL log record
        # the native record of this train() call's first step (its train_loss); None until its loop begins
        self._first_record: int | None = 0
        self._eval_prefix, self._eval_records = "eval", []  # evaluate()'s metric_key_prefix; its records
        # an epoch begun and not yet ended (for the callbacks' on_epoch_*)
        self._epoch_open = False
        # whether this step's eval records wait for its train record, and those waiting (_on_event's "log")
        self._evals_wait, self._waiting_evals = False, []
        self._epoch_stop_said = False  # a callback's should_epoch_stop is warned about once (_on_event)
        self._flow = None  # the native loop's StepFlow of the step's (or epoch's) end being handled
        # whether this train()'s loop has begun a step (a callback's stop acts from then)
        self._steps_begun = False
        self._steps_run = 0  # the optimizer steps this train() call ran (its speed figures)
        # the hub repository, as transformers' Trainer makes it when built (on the main process): a missing login
        # stops the script before it trains
        self.hub_model_id, self._hub = None, None
        if args.push_to_hub:
            self.init_hf_repo()
        # what _refuse_changed_args compares trainer.args with
        self._args_at_init = {
            name: copy.deepcopy(getattr(args, name)) for name in [*FIELDS, *EXTENSIONS] if hasattr(args, name)
        }
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _copy_trl_arguments(self, args) -> None:
        """The attributes TRL's GRPOTrainer copies from its arguments when it is built (callbacks and scripts read
        trainer.num_generations, trainer.beta, ...), with TRL's fallbacks."""
        for name in TRL_ARGUMENT_ATTRIBUTES:
            setattr(self, name, getattr(args, name))
        self.max_tool_calling_iterations = (
            sys.maxsize if args.max_tool_calling_iterations is None else args.max_tool_calling_iterations
        )
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    # ------------------------------------------------------------------ TRL's public methods
    def train(self, resume_from_checkpoint: str | bool | None = None, **_ignored) -> TrainOutput:
        """Train; resume_from_checkpoint True resumes the newest checkpoint in output_dir, a path that one
        (for this call only, as in TRL). The closing record holds transformers' train_* figures and, as TRL's
        log() merges them, the metrics of the steps after the last logging step."""
        native = self.native
        self._refuse_changed_args()
        if self.model.active_adapter != POLICY:
            raise ConfigError(
                f"trainer.model's active adapter is {self.model.active_adapter!r} (set_adapter): lora_grpo trains the "
                f"policy adapter it built, {POLICY!r}, whose weights its optimizer holds; call "
                f"trainer.model.set_adapter({POLICY!r}) before train(), or build the GRPOTrainer on a model whose "
                "active adapter is the one to train"
            )
        if native.state.global_step and not resume_from_checkpoint:
            self._start_again()
        # as transformers' train() reads them: the flow's steps from the args as they are now
        state = self.state
        state.logging_steps, state.eval_steps, state.save_steps = self._flow_steps()
        # True: the newest checkpoint in output_dir, as transformers (run.checkpoint.resolve_checkpoint)
        native.config.resume_from_checkpoint = (
            None
            if not resume_from_checkpoint
            else True
            if resume_from_checkpoint is True
            else str(resume_from_checkpoint)
        )
        started, self._first_record, self._steps_run = time.perf_counter(), None, 0
        self._epoch_open, self._evals_wait, self._waiting_evals = False, False, []
        failure = None
        try:
            native.train()
        except BaseException as error:
            if self._hub is not None and (line := self._hub.still_uploading()):
                native._print(line)
            if not isinstance(error, StepFailed):
                raise
            failure = as_trl_raises(error)
        finally:
            native.config.resume_from_checkpoint = None
        if failure is not None:  # raised here, outside the handler: its chain stays the original's
            raise failure
        # an epoch the native loop did not end (dynamic sampling out of prompts): transformers ends it
        if self._epoch_open:
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            self._epoch_open = False
        if self._first_record is None:
            # a resumed checkpoint at max_steps: the loop never began, no event told the TRL state where it is;
            # transformers' train() begins with on_train_begin all the same
            self._at_checkpoint(native.state)
            self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        loss = [r["loss"] for r in native.state.log_history[self._first_record :] if "loss" in r]
        seconds = time.perf_counter() - started
        steps, batch = (
            self.state.global_step,
            self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps,
        )
        # transformers' speed figures: the steps this call ran, and the share of the schedule's samples they are (a
        # schedule of max_steps counts completions, one of epochs the dataset's rows)
        scheduled = (
            self.args.max_steps * batch * self.args.world_size
            if self.args.max_steps > 0
            else len(self.native.train_dataset) * self.args.num_train_epochs
        )
        metrics = {
            "train_runtime": round(seconds, 4),
            "train_samples_per_second": round(
                scheduled * self._steps_run / max(self.state.max_steps, 1) / seconds, 3
            ),
            "train_steps_per_second": round(self._steps_run / seconds, 3),
            "total_flos": 0.0,
            "train_loss": sum(loss) / max(len(loss), 1),
        }
        # the closing record with the last logging window's metrics, which TRL's log() adds into the same dict: so
        # does train()'s TrainOutput.metrics (what a script's save_metrics("train", ...) writes)
        metrics = {**self._unlogged_window(), **metrics}
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        if self._hub is not None:  # the checkpoints' pushes finish, as transformers waits for them here
            self._hub.wait()
        return TrainOutput(steps, metrics["train_loss"], {**metrics, "epoch": self.state.epoch})

    def _start_again(self) -> None:
        """A second train() without a checkpoint, as transformers' Trainer.train: a new run from the weights
        and the optimizer's moments as they are, at step 0 with a new TrainerState (no history) and the LR
        schedule from its start, the data from its first batch (GRPOTrainer._start_again)."""
        self.native._start_again()
        self.state = self._new_state()
        self.native.scorer.trainer_state = self.state

    def _at_checkpoint(self, native_state) -> None:
        """The TRL state of a resumed checkpoint with no step left: its step, epoch, best checkpoint and TRL log
        history."""
        self._follow_state(native_state)
        self._restore(native_state)
        self._logged_upto = self._first_record = len(native_state.log_history)

    def _follow_state(self, native_state) -> None:
        """The TRL state's step, epoch and best checkpoint (best_metric, best_global_step, best_model_checkpoint:
        run/best.py) are the native loop's."""
        state = self.state
        state.global_step, state.epoch = native_state.global_step, native_state.epoch
        state.best_metric, state.best_global_step = native_state.best_metric, native_state.best_global_step
        state.best_model_checkpoint = native_state.best_model_checkpoint

    def _flow_steps(self) -> tuple[int, int, int]:
        """The TrainerState's logging, eval and save steps from the args (DefaultFlowCallback reads them there).
        (TrainingArguments sets eval_steps to logging_steps when it evaluates every N steps.)"""
        args, total = self.args, self.native.total_steps
        steps = (args.logging_steps, args.eval_steps, args.save_steps)
        return tuple(resolved_steps(value, total, 500) for value in steps)

    def _refuse_changed_args(self) -> None:
        """ConfigError naming each GRPOConfig field that acts through the native config (translate.FIELDS' mapped,
        refused, and lora_grpo's EXTENSIONS) and was changed on trainer.args since the trainer was built: TRL reads
        many of them again in train(), lora_grpo built its adapters, optimizer, schedule and data from them. The flow
        (logging, eval and save steps and strategies) is read again, as in TRL."""
        changed = [
            f"{name} {before!r} → {getattr(self.args, name)!r}"
            for name, before in self._args_at_init.items()
            if not _same(getattr(self.args, name), before)
            and (name in EXTENSIONS or FIELDS[name].how in ("mapped", "refused"))
        ]
        if changed:
            raise ConfigError(
                f"trainer.args changed after the GRPOTrainer was built: {', '.join(changed)}. lora_grpo builds the "
                "run (its adapters, optimizer, learning-rate schedule, batches and sampling) from GRPOConfig when the "
                "trainer is built, so these would not act: build the GRPOTrainer again with the changed GRPOConfig "
                "(trainer.args)"
            )

    def _checkpoint_state(self) -> dict[str, Any]:
        """A checkpoint's trainer_state.json: the TRL state, with the states of the control and of each
        ExportableState callback in its stateful_callbacks (several of one class: a list), as transformers'
        _save_checkpoint writes it."""
        self._follow_state(self.native.state)
        states: dict[str, list] = {}
        for callback in [*self.callback_handler.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                states.setdefault(type(callback).__name__, []).append(callback.state())
        self.state.stateful_callbacks = {
            name: saved[0] if len(saved) == 1 else saved for name, saved in states.items()
        }
        return dataclasses.asdict(self.state)

    def _new_state(self) -> TrainerState:
        """A TrainerState of TRL's meaning at step 0, as transformers' Trainer fills it."""
        args, total = self.args, self.native.total_steps
        logging_steps, eval_steps, save_steps = self._flow_steps()
        return TrainerState(
            max_steps=total,
            num_train_epochs=math.ceil(total / self.native.steps_per_epoch),
            logging_steps=logging_steps,
            eval_steps=eval_steps,
            save_steps=save_steps,
            train_batch_size=args.per_device_train_batch_size,
            total_flos=0.0,  # as TRL's: its inputs have no input_ids for transformers to count from
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
        )

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """lora_grpo's evaluation (greedy scores, pass@k, KL to the base) under transformers' names:
        <prefix>_<metric>, or <prefix>_<name>_<metric> for each set of a dict of eval sets (as the run's, a
        DatasetDict, a plain dict, or a name of one of the run's sets); streams are read whole."""
        if eval_dataset is None and self.native.eval_dataset is None:
            raise ValueError(
                "Trainer: evaluation requires an eval_dataset. Pass one: trainer.evaluate(eval_dataset=...), or "
                "GRPOTrainer(..., eval_dataset=...)"
            )
        if isinstance(eval_dataset, str):
            sets = self.native.eval_dataset if isinstance(self.native.eval_dataset, dict) else {}
            if eval_dataset not in sets:
                raise KeyError(
                    f"evaluate({eval_dataset!r}): not one of this trainer's eval sets {sorted(sets)}"
                )
            eval_dataset = sets[eval_dataset]
        # recorded now, also from a callback inside a step (only the loop's own evals wait for a step's record)
        waiting, self._evals_wait = self._evals_wait, False
        self._eval_prefix, self._eval_records = metric_key_prefix, []
        try:
            self.native.evaluate(eval_sets(eval_dataset))
        finally:
            self._eval_prefix, self._evals_wait = "eval", waiting
        merged = {}
        for record in self._eval_records:
            merged.update(record)
        return merged

    def save_model(
        self, output_dir: str | None = None, _internal_call: bool = False, *, overwrite: bool = False
    ) -> None:
        """The policy as a standard peft adapter (adapter_config.json + adapter_model.safetensors), the
        tokenizer and the adapter's model card (README.md), into output_dir (default args.output_dir). Into the
        run's own output_dir (as TRL's script saves) the files join the run's, each renamed into place (the card
        not over a README of the user's). Any other directory is written whole (run/owned_dir.py): a new one, or
        one save_model wrote before, is replaced; one holding files lora_grpo did not write there is refused
        unless overwrite=True (which replaces its contents); the base model, its tokenizer and the caches are
        refused whatever the flag (TRL writes into any directory, over files of the same names)."""
        target = Path(output_dir or self.native.output_dir)
        if self.accelerator.is_main_process:
            protected = protected_paths(self.native.config, self._base_path)
            label = "save_model's output_dir"
            own = target.expanduser().resolve() == self.native.output_dir.expanduser().resolve()
            into = own and not not_a_runs(target)  # the run's directory: the files join the run's
            if into:
                writer = write_into(target, protected, label=label)
            else:
                writer = write_whole(
                    target,
                    protected,
                    overwrite=overwrite,
                    label=label,
                    flag="overwrite=True (trainer.save_model(output_dir, overwrite=True))",
                    writer="lora_grpo.trl GRPOTrainer.save_model",
                )
            # the adapter's model card, as peft's save_pretrained writes one; into the run's directory not over a
            # README of the user's (another directory is written whole, or refused)
            ours = not into or model_card.is_ours(target / "README.md")
            card = self.native.model_card(target) if ours else None
            with writer as tmp:
                saved = save_adapter(
                    self.model, tmp / "adapter", POLICY, tokenizer=self.processing_class, card=card
                )
                for item in saved.iterdir():
                    os.replace(item, tmp / item.name)
                saved.rmdir()
        # no barrier: a script may call it on the main process alone (transformers' save_model has none either)
        # as transformers': a script's save pushes output_dir
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        *,
        overwrite: bool = False,
    ) -> None:
        """A model card for the saved adapter, output_dir/README.md, as TRL's (open-r1's script calls it after
        save_model): the base, the adapter, how it was trained, how to load it. A README.md there that lora_grpo
        did not write is refused unless overwrite=True (TRL writes over it)."""
        if not self.is_world_process_zero():
            return
        target = Path(self.args.output_dir) / "README.md"
        if not overwrite and not model_card.is_ours(target):
            raise FileExistsError(
                f"{target} exists and is not a model card lora_grpo wrote: not overwritten. Move it away, or "
                "call trainer.create_model_card(..., overwrite=True) to replace it"
            )
        card = self.native.model_card(
            # its "Use it" loads from the hub repository when the run pushes there, as TRL's card does
            self.hub_model_id or Path(self.args.output_dir),
            model_name=model_name,
            dataset_name=dataset_name,
            tags=[tags] if isinstance(tags, str) else list(tags or ()),
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(card, encoding="utf-8")

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or find) the hub repository: hub_model_id, or output_dir's name under the token's user; on the
        main process, as transformers'. HubPushError names what the hub said and the fix."""
        if not self.is_world_process_zero():
            return
        args = self.args
        self._hub = HubRepo.create(
            args.hub_model_id or Path(args.output_dir).absolute().name,
            token=token if token is not None else args.hub_token,
            private=private if private is not None else args.hub_private_repo,
            revision=args.hub_revision,
            strategy=args.hub_strategy,
            always_push=args.hub_always_push,
        )
        self.hub_model_id = self._hub.repo_id

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs,
    ):
        """Save the adapter into output_dir, write its model card and upload output_dir to the hub repository
        (transformers' push_to_hub, which TRL's script calls after save_model): the adapter, the tokenizer, the
        card and the run's config, metrics and results, without the checkpoints, previous runs and
        completions.jsonl. `kwargs` go to create_model_card (dataset_name, tags). The CommitInfo, or a Future of
        it when not `blocking`; None on the other processes."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None:
            model_name = (self.args.hub_model_id or Path(self.args.output_dir).name).split("/")[-1]
        if self._hub is None:  # push_to_hub=False in the config: the repository is made now
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        if model_card.is_ours(Path(self.args.output_dir) / "README.md"):
            self.create_model_card(model_name=model_name, **kwargs)
        else:  # (TRL writes its card over it)
            logger.warning(
                "%s/README.md is not a model card lora_grpo wrote: pushed as it is, as the repository's card",
                self.args.output_dir,
            )
        return self._hub.push_folder(
            Path(self.args.output_dir),
            commit_message,
            blocking=blocking,
            token=token,
            revision=revision if revision is not None else self.args.hub_revision,
        )

    def end(self) -> None:
        """Finish the trackers and leave the process group (transformers ≥ 5.18's Trainer.end)."""
        self.native.reporter.finish()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record a log (with epoch and step) and call the callbacks' on_log, as transformers' Trainer.log."""
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def _get_learning_rate(self) -> float:
        """The schedule's current learning rate, as transformers' Trainer (callbacks call it)."""
        return self.lr_scheduler.get_last_lr()[0]

    # transformers' Trainer methods for scripts, bound as transformers' Trainer binds them (open-r1's script calls
    # log_metrics, save_metrics and save_state after train(): {split}_results.json, all_results.json and
    # trainer_state.json in output_dir, on the main process)
    log_metrics = trainer_pt_utils.log_metrics
    metrics_format = trainer_pt_utils.metrics_format
    save_metrics = trainer_pt_utils.save_metrics
    save_state = trainer_pt_utils.save_state
    get_num_trainable_parameters = trainer_pt_utils.get_num_trainable_parameters
    get_learning_rates = trainer_pt_utils.get_learning_rates
    get_optimizer_group = trainer_pt_utils.get_optimizer_group

    @property
    def optimizer(self):
        """The policy adapter's optimizer (TRL's trainer.optimizer)."""
        return self.native.optimizer

    @optimizer.setter
    def optimizer(self, value) -> None:
        _not_assignable("optimizer", "set optim, learning_rate and the adam_* fields in GRPOConfig")

    @property
    def lr_scheduler(self):
        return self.native.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value) -> None:
        _not_assignable(
            "lr_scheduler", "set lr_scheduler_type, warmup_steps and lr_scheduler_kwargs in GRPOConfig"
        )

    @property
    def train_dataset(self):
        return self.native.train_dataset

    @train_dataset.setter
    def train_dataset(self, value) -> None:
        _not_assignable(
            "train_dataset", "build a GRPOTrainer with train_dataset=... (from trainer.model to go on)"
        )

    @property
    def eval_dataset(self):
        return self.native.eval_dataset

    @eval_dataset.setter
    def eval_dataset(self, value) -> None:
        _not_assignable(
            "eval_dataset", "pass it to trainer.evaluate(eval_dataset=...), or build the GRPOTrainer with it"
        )

    def __getattr__(self, name: str):
        """transformers' Trainer methods of a DataLoader loop, which lora_grpo's loop does not have: an AttributeError
        that says what to use instead (any other missing name: Python's own)."""
        if name in NOT_HERE:
            raise AttributeError(f"GRPOTrainer.{name}: not in lora_grpo.trl; {NOT_HERE[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's: (B, T) bool, the masked tokens whose entropy is at or above the `threshold` quantile of every
        process's masked entropies (TRL passes threshold = 1 − top_entropy_quantile). loss.high_entropy_mask."""
        gather = padded_gather(self.accelerator) if self.accelerator.num_processes > 1 else None
        return high_entropy_mask(entropies, mask, 1.0 - threshold, gather)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's: (B, 1), 1.0 to keep a sequence, 0.0 to drop it (DeepSeek-V3.2's off-policy sequence mask).
        loss.off_policy_mask."""
        return off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )

    # ------------------------------------------------------------------ the loop's named points
    def _on_event(self, event: str, trainer: NativeTrainer, **payload) -> None:
        args, state = self.args, self.state
        self._follow_state(trainer.state)
        handler = self.callback_handler
        if event == "train_begin":
            self._steps_begun = False
            self._restore(trainer.state)
            # the logging window starts here, also at a resumed step, as TRL's (a checkpoint keeps no metrics of
            # the steps after its last log)
            self._first_record = self._logged_upto = len(trainer.state.log_history)
            self.control = handler.on_train_begin(args, state, self.control)
        elif event == "step_begin":
            self._steps_begun = True
            if not self._epoch_open:  # transformers begins an epoch before its first step
                self.control = handler.on_epoch_begin(args, state, self.control)
                self._epoch_open = True
            empty_every = args.torch_empty_cache_steps
            if empty_every is not None and state.global_step % empty_every == 0:
                # as transformers' Trainer.training_step, which TRL's calls (there before each micro-batch of
                # such a step; once here, before its rollout): the accelerator's cached blocks are released
                clear_device_cache()
            self.control = handler.on_step_begin(args, state, self.control)
        elif event == "pre_optimizer_step":
            # transformers' order: a substep end after each micro-batch of the step but its last, then the
            # gradients clipped, then this (here all the micro-batches' gradients are in when they are called)
            for _ in range(args.gradient_accumulation_steps - 1):
                self.control = handler.on_substep_end(args, state, self.control)
            self.control = handler.on_pre_optimizer_step(args, state, self.control)
        elif event == "optimizer_step":
            self.control = handler.on_optimizer_step(args, state, self.control)
        elif event == "step_end":
            self._steps_run += 1
            flow = self._flow = payload["flow"]
            self.control = handler.on_step_end(args, state, self.control)
            self._follow_control(flow)
            # the native loop evaluates before it logs (its plateau trigger reads the eval); transformers logs the
            # step's record first: a logging step's eval records wait for it ("log")
            self._evals_wait = flow.log
        elif event == "epoch_end":
            # after the step's log, eval and save, as transformers; what on_epoch_end asks for (the epoch
            # strategies, a callback's control) follows in their order: log, eval, save
            flow = self._flow = payload["flow"]
            self.control = handler.on_epoch_end(args, state, self.control)
            self._epoch_open, self._evals_wait = False, False
            self._follow_control(flow)
        elif event == "log":
            waiting, self._waiting_evals, self._evals_wait = self._waiting_evals, [], False
            window = self._take_window()
            # transformers logs a step once: an epoch's end right after its logging step adds no record
            if window:
                record = trl_record(window)
                if not args.beta:  # TRL logs kl only with a KL term (the native records hold its 0)
                    record.pop("kl", None)
                self.log(record)
            self.control.should_log = False
            for one in waiting:
                self._eval_record(one)
            # what on_log (or on_evaluate) asked for acts after it in this step: an eval, then a save
            self._ask_flow(
                evaluate=self.control.should_evaluate and not waiting, save=self.control.should_save
            )
        elif event == "evaluate":
            if self._evals_wait:
                self._waiting_evals.append(payload)
            else:
                self._eval_record(payload)
            self.control.should_evaluate = False
            self._ask_flow(save=self.control.should_save)
        elif event == "save":
            # on_save for the saves transformers makes (the flow's); not for the run's last checkpoint, which
            # lora_grpo always keeps (also under save_strategy "no"), nor a failure's or a stop's
            if payload["due"]:
                # transformers' _push_from_checkpoint, before on_save, with its commit message: only when the config
                # asks (a script's own push_to_hub() makes the repository without args.push_to_hub)
                if args.push_to_hub and self._hub is not None and self._hub.wants():
                    self.control = handler.on_push_begin(args, state, self.control)
                    done = (
                        f"step {state.global_step}"
                        if args.save_strategy == "steps"
                        else f"epoch {int(state.epoch or 0)}"
                    )
                    self._hub.push_checkpoint(payload["path"], f"Training in progress, {done}")
                self.control = handler.on_save(args, state, self.control)
            self.control.should_save = False
        # what a checkpoint keeps of the TRL state beyond the native loop's (the token count the scorer keeps here)
        trainer.state.extra = {
            "trl_log_history": state.log_history,
            "num_input_tokens_seen": state.num_input_tokens_seen,
        }
        # a callback's stop, whichever event it came in (EarlyStoppingCallback's at on_evaluate): the run ends after
        # this step's log, eval and save, as transformers checks after _maybe_log_save_evaluate; one asked before the
        # first step (on_train_begin, eval_on_start's on_evaluate) ends the run after that step, as in transformers
        if self._steps_begun:
            trainer.stop_requested = trainer.stop_requested or self.control.should_training_stop
        if self.control.should_epoch_stop and not self._epoch_stop_said:
            logger.warning(
                "A callback set control.should_epoch_stop: lora_grpo does not end an epoch early (each epoch "
                "draws every prompt of its permutation, and the step count is the run's); the epoch goes on. "
                "control.should_training_stop ends the run."
            )
            self._epoch_stop_said = True

    def _ask_flow(self, *, evaluate: bool = False, save: bool = False) -> None:
        """An eval or a save a callback asked for after the step's end (in on_log or on_evaluate), added to the
        flow the native loop still reads, as transformers' _maybe_log_save_evaluate logs, evaluates, then saves."""
        if self._flow is not None:
            self._flow.evaluate = self._flow.evaluate or evaluate
            self._flow.save = self._flow.save or save

    def _follow_control(self, flow) -> None:
        """What the callbacks' control asks of the native loop at step_end and epoch_end: a log, an eval, a save
        (flow, a StepFlow). (The run's stop: after every event, _on_event.)"""
        flow.log, flow.evaluate, flow.save = (
            self.control.should_log,
            self.control.should_evaluate,
            self.control.should_save,
        )

    def _completions_table(self, step: int, records: list[dict[str, Any]]) -> None:
        """With log_completions, TRL's table of the step's completions to W&B (its run, when there is one) and
        Trackio, the report_to trackers that take tables (completions.jsonl has them all)."""
        names = tracker_names(self.args.report_to)
        backends = []
        if "wandb" in names:
            import wandb

            backends += [wandb] if wandb.run is not None else []
        if "trackio" in names:
            import trackio

            backends += [trackio] if hasattr(trackio, "Table") else []  # (older trackio has no tables)
        columns, rows = table_of(records)
        for backend in backends:
            backend.log({"completions": backend.Table(columns=columns, data=rows)})

    def _take_window(self) -> list[dict[str, Any]]:
        """The native step records not yet averaged into a TRL record (the logging window), taken."""
        window = self.native.state.log_history[self._logged_upto :]
        self._logged_upto = len(self.native.state.log_history)
        return window

    def _unlogged_window(self) -> dict[str, float]:
        """TRL's metrics of the steps after the last logging step, as its log() adds them to the closing record
        (empty when there are none): not loss, grad_norm and learning_rate, which transformers adds at a logging
        step only."""
        window = self._take_window()
        record = trl_record(window) if window else {}
        return {k: v for k, v in record.items() if k not in ("loss", "grad_norm", "learning_rate")}

    def _eval_record(self, payload: dict[str, Any]) -> None:
        """One eval set's record, as transformers' evaluate() logs it: <prefix>[_<name>]_<metric>, with the
        runtime figures, then on_evaluate."""
        prefix = (
            self._eval_prefix if payload["set_name"] is None else f"{self._eval_prefix}_{payload['set_name']}"
        )
        seconds = payload["seconds"]
        record = {f"{prefix}_{k.removeprefix('eval/')}": v for k, v in payload["metrics"].items()}
        record.update(
            {
                f"{prefix}_runtime": round(seconds, 4),
                f"{prefix}_samples_per_second": round(payload["rows"] / seconds, 3) if seconds else 0.0,
                f"{prefix}_steps_per_second": round(1 / seconds, 3) if seconds else 0.0,
            }
        )
        self.log(record)
        self._eval_records.append({**record, "epoch": self.state.epoch})
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, record)

    def _restore(self, native_state) -> None:
        """On resume: TRL's log history and token count, from the native checkpoint's state. A checkpoint of a
        step whose end failed (native_state.unfinished_step) ends that step again: its records, written before
        the failure, are dropped so that they are not there twice."""
        extra = native_state.extra
        if extra and extra.get("trl_log_history") is not self.state.log_history:
            history = list(extra.get("trl_log_history", []))
            if native_state.unfinished_step:
                history = [r for r in history if r.get("step", 0) < native_state.global_step]
            self.state.log_history = history
            self.state.num_input_tokens_seen = int(extra.get("num_input_tokens_seen", 0))
