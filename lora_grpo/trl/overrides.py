"""A subclass of the front door's GRPOTrainer that overrides a method of TRL's training loop: refused by name.

TRL's GRPOTrainer is a transformers Trainer whose loop calls its own methods, so research code subclasses it and
overrides them: `_generate_and_score_completions` most often, then `compute_loss` / `_compute_loss`,
`_calculate_rewards`, `_generate_single_turn`, `training_step`, `create_optimizer`, ... (a sample of 29 public
subclasses: 24 override one). lora_grpo.trl runs lora_grpo's own loop, which calls none of them, so such an
override would be silently ignored: the subclass is refused when it is built, naming each method and what takes
its place here. A method a script may call itself but whose in-loop call lora_grpo makes without it (`evaluate`,
`save_model`, `create_model_card`, `add_callback`) is warned about. `log` and `is_world_process_zero` are called
by the front door itself: overriding them works as in TRL.

The names are TRL 1.16's GRPOTrainer's and its base's, and the transformers Trainer methods their loop calls.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

# what replaces each group of methods here, and the group's names
LOOP_METHODS: dict[str, tuple[str, ...]] = {
    "reward functions (reward_funcs, with log_extra / log_metric), tools= or environment_factory=, and GRPOConfig's "
    "generation fields (temperature, top_p, max_completion_length, ...)": (
        "_generate_and_score_completions",
        "_calculate_rewards",
        "_generate_single_turn",
        "_generate",
        "_tokenize_prompts",
        "_tool_call_loop",
        "_get_tool_suffix_ids",
        "_log_completion_extra",
        "_log_metric",
    ),
    "GRPOConfig's loss fields (loss_type, beta, epsilon, epsilon_high, top_entropy_quantile, "
    "importance_sampling_level, ...): the loss and the log-probs are lora_grpo's": (
        "compute_loss",
        "_compute_loss",
        "_get_per_token_logps_and_entropies",
        "get_high_entropy_mask",
        "get_off_policy_mask",
        "get_gamma_weights",
        "compute_loss_context_manager",
    ),
    "callbacks (a TrainerCallback's on_step_begin, on_log, on_save, ...) and GRPOConfig's optimizer, schedule and "
    "save fields: the loop, its data and its checkpoints are lora_grpo's": (
        "training_step",
        "_prepare_inputs",
        "create_optimizer",
        "create_scheduler",
        "get_decay_parameter_names",
        "get_train_dataloader",
        "_get_train_sampler",
        "get_eval_dataloader",
        "_get_eval_sampler",
        "get_batch_samples",
        "_set_signature_columns_if_needed",
        "prediction_step",
        "evaluation_loop",
        "_inner_training_loop",
        "_maybe_log_save_evaluate",
        "_evaluate",
        "_save_checkpoint",
        "_save",
        "_load_from_checkpoint",
        "_load_optimizer_and_scheduler",
        "_load_rng_state",
        "_save_rng_state",
        "_wrap_model",
        "floating_point_ops",
        "store_flos",
    ),
}
# called by scripts; in TRL also by its loop (an eval or save step, a checkpoint's card, the constructor's callbacks)
SCRIPT_METHODS = ("evaluate", "save_model", "create_model_card", "add_callback")


def overridden(cls: type, front_door: type, names) -> list[str]:
    """The names of `names` that `cls` (a subclass of `front_door`) defines otherwise than `front_door` does."""
    return [
        name
        for name in names
        if (mine := inspect.getattr_static(cls, name, None)) is not None
        and mine is not inspect.getattr_static(front_door, name, None)
    ]


def refuse_loop_overrides(cls: type, front_door: type) -> None:
    """Refuse a subclass that overrides a method of TRL's loop (TypeError naming each, grouped by what replaces it
    here); warn about an override of a method scripts call (SCRIPT_METHODS)."""
    if cls is front_door:
        return
    found = {
        instead: names
        for instead, group in LOOP_METHODS.items()
        if (names := overridden(cls, front_door, group))
    }
    if found:
        said = "; ".join(f"{', '.join(names)}: use {instead}" for instead, names in found.items())
        raise TypeError(
            f"{cls.__name__} overrides methods of TRL's training loop, which lora_grpo.trl never calls (it runs "
            f"lora_grpo's own loop), so the override would be silently ignored. {said}. Or train this subclass "
            "with TRL itself"
        )
    for name in overridden(cls, front_door, SCRIPT_METHODS):
        logger.warning(
            "%s overrides %s: it runs when your script calls it, but lora_grpo's loop %s without it",
            cls.__name__,
            name,
            {
                "evaluate": "evaluates (eval_strategy)",
                "save_model": "saves its checkpoints",
                "create_model_card": "writes its checkpoints",
                "add_callback": "adds the callbacks given to the constructor",
            }[name],
        )
