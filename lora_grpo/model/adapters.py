"""The two adapters on the one frozen base, and switching between them.

    policy    = base + ΔW_policy      adapter "default" (POLICY), trainable
    reference = base + ΔW_ref         adapter "reference" (the reference slot), frozen; changed only
                                      by reference.sync_reference
    start     = base (+ ΔW_init)      adapters off, or adapter "base" (a frozen copy of the warm-start
                                      adapter) when the run started from init_adapter: base_forward

peft's `set_adapter` marks the adapter it activates trainable and every other one frozen;
`use_adapter` switches and then restores every requires_grad flag, so a reference forward never
leaks trainability into the slot or out of the policy. Imports only torch (peft lazily).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

# The policy is peft's default adapter, so that peft's own API treats the trainer's model as TRL's (one adapter
# "default", and with a KL term a frozen reference beside it): save_pretrained writes the policy at the
# directory's root (PeftModel.from_pretrained loads it from there), get_peft_model_state_dict(model) returns it,
# merge_and_unload merges it.
POLICY, REFERENCE = "default", "reference"
# On disk a checkpoint holds each adapter in a directory of its role's name (run/checkpoint.py).
POLICY_DIR, REFERENCE_DIR = "policy", "reference"
# A frozen copy of the warm-start adapter (model.attach_base_slot): the model a run that started from
# init_adapter started from. Fresh runs have none: their starting point is the base, adapters off.
BASE = "base"
# The Hub tags of what lora_grpo trains: its model cards' and the model's own (model_tags, which peft's card of a
# script's trainer.model.save_pretrained lists): the library and the method (TRL tags its GRPO models "trl", "grpo").
TAGS = ("lora_grpo", "grpo")


def lora_layers(model: nn.Module, adapters=(POLICY, REFERENCE)) -> list[tuple[str, nn.Module]]:
    """Every LoRA layer that carries all of `adapters`."""
    from peft.tuners.lora import LoraLayer

    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and all(a in module.lora_A for a in adapters)
    ]


def policy_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA factors of the policy (found through the LoRA layers, not by name)."""
    return [
        p
        for _, m in lora_layers(model, (POLICY,))
        for p in (m.lora_A[POLICY].weight, m.lora_B[POLICY].weight)
        if p.requires_grad
    ]


@contextmanager
def use_adapter(model: nn.Module, adapter: str):
    """Run the block with `adapter` active, then restore the previous adapter and every requires_grad flag."""
    previous = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(adapter)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        for p, flag in flags:
            p.requires_grad_(flag)


def set_training(model: nn.Module, training: bool) -> None:
    """``model.train(training)``, skipped when the model's own flag already says so. The trainer only
    ever switches the whole model, so its root flag stands for every module's, and the walk over
    every module (about 2 µs a module, hundreds of modules, several times a step) is paid only on a
    real switch: into train mode and back once per optimizer update."""
    if model.training != training:
        model.train(training)


@contextmanager
def training_flag(model: nn.Module, training: bool):
    """Run the block with ``model.training == training`` (set_training), then restore the flag."""
    was_training = model.training
    set_training(model, training)
    try:
        yield model
    finally:
        set_training(model, was_training)


def eval_mode(model: nn.Module):
    """Run the block in eval mode (dropout off, as when sampling), then restore the training flag."""
    return training_flag(model, False)


def train_mode(model: nn.Module):
    """Run the block in train mode (gradient checkpointing and dropout on), then restore the flag.
    Between optimizer updates the trainer's model stays in eval mode, where sampling and log-probs run."""
    return training_flag(model, True)


@contextmanager
def reference_forward(model: nn.Module):
    """No-grad forward through the reference adapter: `with reference_forward(model): model(...)`."""
    with use_adapter(model, REFERENCE), torch.no_grad():
        yield model


@contextmanager
def base_forward(model: nn.Module):
    """No-grad forward through the model the run started from: the "base" slot (a frozen copy of the
    warm-start adapter) when the model has one, else the base with every adapter disabled (peft's
    `disable_adapter`). Every requires_grad flag is restored afterwards (peft's re-enable marks the
    active adapter trainable)."""
    if BASE in getattr(model, "peft_config", {}):
        with use_adapter(model, BASE), torch.no_grad():
            yield model
        return
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.disable_adapter(), torch.no_grad():
            yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
