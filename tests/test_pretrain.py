"""The tiny bases' shared pre-training loop (tasks/pretrain.py): its schedule and its determinism."""

import math

import torch

from lora_grpo.tasks.pretrain import pretrain_tiny_model, warmup_cosine


def test_warmup_then_cosine_to_a_tenth():
    lr = warmup_cosine(warmup_steps=4, steps=14)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(4) == 1.0  # the decay starts at the peak
    assert math.isclose(lr(9), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # half-way: 0.55
    assert math.isclose(lr(9), 0.55) and math.isclose(lr(14), 0.1)


def test_the_loop_is_deterministic_by_seed_and_leaves_the_callers_rng_alone():
    target = torch.tensor([[1.0, -2.0]])

    def build():
        torch.manual_seed(3)
        return torch.nn.Linear(2, 2)

    def batch_loss(model, gen):
        x = torch.randn(8, 2, generator=gen)
        return ((model(x) - x @ target.T) ** 2).mean()

    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    run = [
        pretrain_tiny_model(
            build, batch_loss, seed=s, steps=30, learning_rate=0.05, warmup_steps=3, log_every=0
        )
        for s in (0, 0, 1)
    ]
    assert torch.rand(1).equal(expected_next)  # the caller's random state is where it was
    (a, losses_a, _), (b, losses_b, _), (c, losses_c, _) = run
    assert losses_a == losses_b and all(x.equal(y) for x, y in zip(a.parameters(), b.parameters()))
    assert losses_c != losses_a  # another seed, other batches
    assert losses_a[-1] < 0.5 * losses_a[0]  # it trains
