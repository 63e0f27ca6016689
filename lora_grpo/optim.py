"""The optimizer side of a step: AdamW (or bitsandbytes' 8-bit ones), the LR schedule over updates,
gradient averaging across processes, and the config's settings on a resumed optimizer."""

from __future__ import annotations

import torch

from .config import GRPOConfig


def build_optimizer(params: list[torch.nn.Parameter], config: GRPOConfig) -> torch.optim.Optimizer:
    kwargs = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    import bitsandbytes as bnb

    cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[config.optimizer]
    return cls(params, **kwargs)


def build_scheduler(optimizer, config: GRPOConfig, total_steps: int):
    """The LR schedule over optimizer updates: num_iterations per training step."""
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[config.lr_scheduler]
    updates = config.num_iterations
    return get_scheduler(
        name, optimizer, num_warmup_steps=config.warmup_steps * updates, num_training_steps=total_steps * updates
    )


def apply_config(optimizer, scheduler, config: GRPOConfig) -> float:
    """After loading a checkpoint's optimizer and scheduler: the config's learning rate, betas and
    weight decay win over the saved ones (resuming with a lower learning_rate must lower it).
    Returns the saved learning rate."""
    saved_lr = scheduler.base_lrs[0]
    scheduler.base_lrs = [config.learning_rate for _ in scheduler.base_lrs]
    factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors):
        group.update(lr=config.learning_rate * factor, initial_lr=config.learning_rate,
                     betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay)
    return saved_lr


def average_gradients(params: list[torch.nn.Parameter], accelerator) -> None:
    """Mean of every process's gradients in one all-reduce of one flat buffer.

    Not accelerate's DDP wrapper: the loss reaches the model through its decoder and a chunked LM
    head (logprobs.py), never through the wrapper's forward, so DDP's reducer would not see the
    step. One flat buffer costs one collective per step instead of one per LoRA tensor.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
