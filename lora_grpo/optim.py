"""The optimizer side of a step: AdamW (or bitsandbytes' 8-bit ones), the LR schedule over updates,
float16's loss scale, gradient averaging across processes, and the config's settings on a resumed
optimizer."""

from __future__ import annotations

import inspect
import json
import math

import torch

from .config import ConfigError, GRPOConfig


def build_optimizer(params: list[torch.nn.Parameter], config: GRPOConfig) -> torch.optim.Optimizer:
    kwargs = dict(
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
    )
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    import bitsandbytes as bnb

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[config.optimizer]
    return cls(params, **kwargs)


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's optimizer state back to what its first step creates: moments and step
    counts zero (ProRL's optimizer reset at a reference reset, Liu et al. 2025 §2.3.1).

    In place, not `state.clear()`: bitsandbytes' paged optimizers keep their state in paged buffers
    that their page manager never frees, so re-creating the state would leak them at every reset.
    Zeros are exactly what torch's AdamW and bitsandbytes' 8-bit AdamW (blockwise absmax included)
    initialise; bitsandbytes' `qmap*` entries are the shared quantization maps, constants, kept.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if key.startswith("qmap"):
                continue
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                state[key] = type(value)(0)


class WarmupRestarts:
    """ref_sync_restart_warmup: the LR multiplier of update u becomes schedule(u) · warmup(u − u_sync),
    u_sync the update count at the last sync, warmup(k) = min(1, k / warmup updates): the schedule's
    own linear ramp (transformers'; 0 on the first update after the sync). Before any sync it is 1.

    `restart_update` is the run's state, in checkpoints through state_dict (the scheduler's own
    state_dict leaves out plain functions such as the wrapped multipliers)."""

    def __init__(self, warmup_updates: int):
        self.warmup_updates = warmup_updates
        self.restart_update: int | None = None

    def state_dict(self) -> dict[str, int | None]:
        return {"restart_update": self.restart_update}

    def load_state_dict(self, state: dict[str, int | None] | int | None) -> None:
        # Checkpoints before TrainState stored the bare update number (or None).
        self.restart_update = state.get("restart_update") if isinstance(state, dict) else state

    def factor(self, update: int) -> float:
        if self.restart_update is None:
            return 1.0
        return min(1.0, (update - self.restart_update) / max(1, self.warmup_updates))

    def restart(self, optimizer, scheduler) -> None:
        """Restart the warmup at the scheduler's current update, and apply the new LR right away."""
        self.restart_update = scheduler.last_epoch
        refresh_lr(optimizer, scheduler)


# What GradScaler.state_dict() holds: each entry's type and whether it may be 0 (the scale, its factors and
# its interval are above 0; the growth count is 0 or more).
SCALER_ENTRIES = {
    "scale": (float, False),
    "growth_factor": (float, False),
    "backoff_factor": (float, False),
    "growth_interval": (int, False),
    "_growth_tracker": (int, True),
}


class LossScale:
    """The dynamic loss scale of a model that computes in float16: torch's GradScaler at its defaults
    (accelerate's, so TRL's under fp16=True): the loss is multiplied by the scale (2**16 at the start)
    before backward, so that small activation gradients stay above float16's smallest values (6.0e-8;
    without it, a tiny model's adapter gradient for advantages of 1e-4 is 62% off and 12% of its
    entries zero: tests/test_float16.py); the float32 adapter gradients are divided by it before
    clipping; a step whose gradients overflowed is skipped and halves the scale, and 2000
    overflow-free steps in a row double it.

    Off (every call a no-op, scale 1) for float32 and bfloat16, whose exponent is float32's. The scale
    and its growth count are the run's state, in checkpoints through state_dict (a checkpoint without
    them, from an older version or an unscaled run, starts at the initial scale)."""

    def __init__(self, enabled: bool, device: torch.device | str):
        self.scaler = torch.amp.GradScaler(torch.device(device).type, enabled=enabled)
        self._made = False  # whether GradScaler's scale tensor exists (unscale)

    @classmethod
    def for_model(cls, model: torch.nn.Module, device: torch.device | str) -> "LossScale":
        """On when the model computes anywhere in float16: its embeddings (a model loaded in float16), or a
        quantized layer's compute dtype (a 4-bit base with bnb_4bit_compute_dtype float16 keeps its
        embeddings, norms and head in the dtype it was loaded in, float32, while its layers run forward
        and backward in float16, where small gradients underflow unscaled)."""
        half = model.get_input_embeddings().weight.dtype == torch.float16 or any(
            getattr(module, "compute_dtype", None) == torch.float16 for module in model.modules()
        )
        return cls(half, device)

    @property
    def enabled(self) -> bool:
        return self.scaler.is_enabled()

    @property
    def value(self) -> float:
        """The scale the next backward multiplies the loss by (1.0 when off)."""
        return float(self.scaler.get_scale())

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (after averaging over processes, so that every
        process sees the same overflow and skips alike); an overflow leaves inf/NaN in them."""
        if self.enabled and not self._made:
            # GradScaler makes its scale on the device of the first loss it scales, and unscale_ fails
            # without one: a first step whose rows all have zero advantage scaled none. Scaling a zero
            # on the gradients' device (this process's own) makes it.
            self.scaler.scale(torch.zeros((), device=optimizer.param_groups[0]["params"][0].device))
            self._made = True
        self.scaler.unscale_(optimizer)

    def update(self) -> None:
        """After the step (taken or skipped): halve on an overflow unscale found, else count towards doubling."""
        self.scaler.update()

    def forget_step(self) -> None:
        """After a step that raised between unscale and update (an out-of-memory error in the optimizer's
        step): the scale and its count as they were, and the optimizer ready to be unscaled again, so that
        a later train() on the same trainer can step. GradScaler has no public call for this: its
        per-optimizer record is a defaultdict that rebuilds a fresh entry for each optimizer."""
        if self.enabled:
            self.scaler._per_optimizer_states.clear()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:  # {}: an unscaled run's (a scaler that is off loads nothing anyway)
            self.scaler.load_state_dict(state)

    @staticmethod
    def saved_problems(state: dict) -> list[str]:
        """What is wrong in a saved loss scale (lora_grpo_state.json's "loss_scale"), entry by entry: it is {}
        (an unscaled run's) or GradScaler's five entries as SCALER_ENTRIES says; [] when it fits."""
        if not state:
            return []
        problems = []
        for key, (kind, zero) in SCALER_ENTRIES.items():
            value = state.get(key)
            fits = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
            if not (fits and math.isfinite(value) and (value >= 0 if zero else value > 0)):
                must = ("a whole number" if kind is int else "a number") + (
                    ", 0 or more" if zero else " above 0"
                )
                problems.append(f"loss_scale.{key} is {json.dumps(value)}; it must be {must}")
        return problems


def refresh_lr(optimizer, scheduler) -> None:
    """Set each group's LR (and the scheduler's last LR) from the multipliers at the current update."""
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch keeps no public setter)


def steps_of(value: float, total_steps: int) -> int:
    """A number of steps given as a count, or below 1 as a share of the run (transformers' rule: rounded up)."""
    return int(value) if value >= 1 or value == 0 else math.ceil(value * total_steps)


def build_scheduler(optimizer, config: GRPOConfig, total_steps: int, restarts: WarmupRestarts | None = None):
    """The LR schedule over the run's optimizer steps (every update is a step), transformers' get_scheduler
    by name with lr_scheduler_kwargs; with `restarts`, multiplied by its restarted warmup (WarmupRestarts)."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    try:
        scheduler = get_scheduler(
            name,
            optimizer,
            num_warmup_steps=steps_of(config.warmup_steps, total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=dict(config.lr_scheduler_kwargs) or None,
        )
    # a keyword the schedule lacks or needs, or a value of a wrong type
    except (TypeError, ValueError) as error:
        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

        takes = [
            p
            for p in inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[name]).parameters
            if p not in ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")
        ]
        raise ConfigError(
            f"lr_scheduler={config.lr_scheduler!r} with lr_scheduler_kwargs={dict(config.lr_scheduler_kwargs)}: "
            f"{error}. Its keywords: {', '.join(takes) or 'none'} (transformers' schedule of that name)"
        ) from error
    if restarts is not None:

        def restarted(schedule):
            return lambda update: schedule(update) * restarts.factor(update)

        scheduler.lr_lambdas = [restarted(f) for f in scheduler.lr_lambdas]
    return scheduler


def apply_config(optimizer, scheduler, config: GRPOConfig) -> float:
    """After loading a checkpoint's optimizer and scheduler: the config's learning rate, betas and
    weight decay win over the saved ones (resuming with a lower learning_rate must lower it).
    Returns the saved learning rate."""
    saved_lr = scheduler.base_lrs[0]
    scheduler.base_lrs = [config.learning_rate for _ in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group.update(
            initial_lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
    refresh_lr(optimizer, scheduler)  # the new learning rate × the multiplier at the current update
    return saved_lr


def average_gradients(params: list[torch.nn.Parameter], accelerator) -> None:
    """Mean of every process's gradients in one all-reduce of one flat buffer.

    Not accelerate's DDP wrapper: the loss reaches the model through its decoder and a chunked LM
    head (algo/logprobs.py), never through the wrapper's forward, so DDP's reducer would not see the
    step. One flat buffer costs one collective per step instead of one per LoRA tensor.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()


def sum_over_processes(values: dict[str, float], accelerator) -> dict[str, float]:
    """Each value summed over every process (one all-reduce); as is with one process."""
    if accelerator.num_processes == 1:
        return values
    keys = sorted(values)
    totals = accelerator.reduce(torch.tensor([values[k] for k in keys], device=accelerator.device), "sum")
    return dict(zip(keys, totals.tolist()))
