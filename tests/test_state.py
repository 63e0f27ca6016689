"""The loop's state is one object: a checkpoint saves and restores every field of it, including
fields added later (the test walks the dataclass, it names none of them)."""

import dataclasses
import re
import typing

import pytest
from helpers import make_trainer

from lora_grpo.state import FROM_CONFIG, PER_PROCESS, TrainState

# Fields whose resume is a decision, tested on its own: the process count must match
# (test_checkpoint), the sizes in use follow the memory plan (test_memory), the best checkpoint is the one
# under the run's output_dir, when it is there (test_best_checkpoint).
DECIDED_ON_RESUME = {"num_processes", "micro_batch_size", "gradient_checkpointing", "best_model_checkpoint"}
# Each process's own fields (tensors, in trainer_state.pt): their round trip is the test below this one's.
PER_PROCESS_FIELDS = {f.name for f in dataclasses.fields(TrainState) if PER_PROCESS in f.metadata}


def _other(value, name):
    """A value of the same kind that no run would have by default."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, list):  # another element of the kind it holds (records, or numbers)
        return value + [
            {"step": 99, "marker": name}
            if not value or isinstance(value[0], dict)
            else _other(value[0], name)
        ]
    if isinstance(value, dict):
        return {**value, "marker": [False, 1] if name == "episodes" else name}
    # None: a value of the field's own type (the checkpoint's reader refuses any other)
    if value is None:
        kind = next(
            t for t in typing.get_args(typing.get_type_hints(TrainState)[name]) if t is not type(None)
        )
        kind = typing.get_origin(kind) or kind
        return {int: 7, float: 7.5, str: f"{name} set by the test", dict: {"marker": name}}[kind]
    raise TypeError(f"no test value for a {type(value).__name__} in {name}")


def _change_part(part):
    """A part with its own state (data position, sync schedule, warmup restarts): every entry moved."""
    saved = part.state_dict()
    fixed = {"seed", "num_rows", "prompts_per_step"}  # what the data position must match on load
    part.load_state_dict(
        {
            k: v if k in fixed else (3 if v is None else [0.5] if v == [] else _other(v, k))
            for k, v in saved.items()
        }
    )


def test_a_checkpoint_restores_every_field_of_the_train_state(tiny_base_dir, tmp_path):
    # float16: its loss scale is state too (float32 and bfloat16 runs have none)
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path / "a",
        quantization="none",
        torch_dtype="float16",
        max_steps=2,
        save_steps=0,
        ref_sync_steps=1,
        ref_sync_alpha=0.5,
    )
    trainer.train()
    fresh = make_trainer(
        tiny_base_dir,
        tmp_path / "b",
        quantization="none",
        torch_dtype="float16",
        max_steps=2,
        save_steps=0,
        ref_sync_steps=1,
        ref_sync_alpha=0.5,
    )
    state = trainer.state
    for f in dataclasses.fields(TrainState):
        if f.name in FROM_CONFIG | DECIDED_ON_RESUME | PER_PROCESS_FIELDS:
            continue
        value = getattr(state, f.name)
        if hasattr(value, "state_dict"):
            _change_part(value)
        else:  # away from what a fresh run holds, so that a field left out of the round trip shows
            setattr(state, f.name, _other(getattr(fresh.state, f.name), f.name))
    saved = trainer.save_checkpoint()
    expected = state.state_dict()

    before = fresh.state.state_dict()
    fresh.load_checkpoint(saved)
    after = fresh.state.state_dict()
    checked = [
        f.name
        for f in dataclasses.fields(TrainState)
        if f.name not in FROM_CONFIG | DECIDED_ON_RESUME | PER_PROCESS_FIELDS
    ]
    assert len(checked) > 15  # transformers' fields and ours
    for name in checked:
        assert after[name] == expected[name], name
        assert after[name] != before[name], f"{name}: the test did not change it"


def test_a_checkpoint_restores_each_processs_own_state(tiny_base_dir, tmp_path):
    import torch

    from lora_grpo.batch import Batch, RolloutSteps
    from lora_grpo.run.checkpoint import load_checkpoint_state

    assert PER_PROCESS_FIELDS == {"generation"}  # a new one needs its values in this test
    g = torch.Generator().manual_seed(0)

    def batch(ref: bool) -> Batch:
        return Batch(
            input_ids=torch.randint(0, 50, (4, 9), generator=g),
            attention_mask=torch.ones(4, 9, dtype=torch.long),
            completion_mask=(torch.rand(4, 5, generator=g) > 0.3).float(),
            advantages=torch.randn(4, generator=g),
            old_logp=-torch.rand(4, 5, generator=g),
            ref_logp=-torch.rand(4, 5, generator=g) if ref else None,
        )

    trainer = make_trainer(tiny_base_dir, tmp_path / "a", quantization="none", max_steps=2, save_steps=0)
    full = batch(ref=True)
    # steps() slices one rollout: each step must be saved alone, not with its rollout's whole storage
    trainer.state.generation = RolloutSteps((*full.steps(2), batch(ref=False)), epoch=3, epoch_ended=True)
    saved = trainer.save_checkpoint()
    fresh = make_trainer(tiny_base_dir, tmp_path / "b", quantization="none", max_steps=2, save_steps=0)
    assert fresh.state.generation is None
    fresh.load_checkpoint(saved)
    got, expected = fresh.state.generation, trainer.state.generation
    assert (got.epoch, got.epoch_ended, len(got)) == (3, True, 3)
    for a, b in zip(got.steps, expected.steps):
        for f in dataclasses.fields(Batch):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (x is None and y is None) or (torch.equal(x, y) and x.dtype == y.dtype), f.name
    _, blobs = load_checkpoint_state(saved)
    first = blobs["process_state"][0]["generation"]["steps"][0]["input_ids"]
    assert first.untyped_storage().nbytes() == first.numel() * first.element_size()


def test_the_state_is_transformers_trainer_state(tiny_base_dir, tmp_path):
    from transformers import TrainerState

    trainer = make_trainer(tiny_base_dir, tmp_path, quantization="none", max_steps=1)
    trainer.train()
    assert isinstance(trainer.state, TrainerState)
    assert trainer.state.global_step == 1 and trainer.state.max_steps == 1
    assert trainer.state.epoch == pytest.approx(1 / 12)


@pytest.fixture(scope="module")
def run_state(tiny_base_dir, tmp_path_factory):
    """A fresh run's TrainState (every part in place)."""
    return make_trainer(tiny_base_dir, tmp_path_factory.mktemp("state"), quantization="none").state


# Issue 47: a hand-edited trainer_state.json failed with "invalid literal for int()" ("two"), an AttributeError
# (batches null), or was taken (global_step -3: the run then logged steps -2 ... 3).
# A float16 run's saved loss scale (GradScaler.state_dict() at its defaults).
SCALER = {
    "scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 0,
}


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"global_step": "two"}, 'global_step is "two"; it must be an integer'),
        ({"batches": None}, "batches is null; it must be an object"),
        ({"global_step": -3}, "global_step is -3; it must be 0 or more"),
        ({"global_step": True}, "global_step is true; it must be an integer"),
        ({"num_processes": 0}, "num_processes is 0; it must be 1 or more"),
        ({"epoch": float("nan")}, "epoch is NaN; it must be 0 or more"),
        ({"log_history": {"loss": 1.0}}, 'log_history is {"loss": 1.0}; it must be a list'),
        ({"unfinished_step": []}, "unfinished_step is []; it must be an object or null"),
        (
            {"loss_scale": {**SCALER, "scale": "big"}},
            'loss_scale.scale is "big"; it must be a number above 0',
        ),
        (
            {"loss_scale": {**SCALER, "_growth_tracker": -1}},
            "loss_scale._growth_tracker is -1; it must be a whole number, 0 or more",
        ),
        (
            {"loss_scale": {"scale": 2.0}},
            "loss_scale.growth_interval is null; it must be a whole number above 0",
        ),
    ],
    ids=[
        "string-step",
        "null-part",
        "negative-step",
        "bool-step",
        "no-processes",
        "nan",
        "list",
        "obj",
        "string-scale",
        "negative-count",
        "scale-entries-missing",
    ],
)
def test_a_saved_state_with_a_wrong_value_is_refused_naming_the_field(run_state, edit, named):
    good = run_state.state_dict()
    assert TrainState.saved_problems(good) == []
    bad = good | edit
    assert [p for p in TrainState.saved_problems(bad) if named in p]
    before = run_state.state_dict()
    with pytest.raises(ValueError, match=re.escape(named)):
        run_state.load_state_dict(bad)
    # refused before any field was set
    assert run_state.state_dict() == before


def test_fields_a_run_takes_from_its_config_are_not_checked(run_state):
    # max_steps is not restored (FROM_CONFIG): what the file holds there cannot break a resume
    assert TrainState.saved_problems({**run_state.state_dict(), "max_steps": "many"}) == []


def test_micro_batches_keep_exactly_the_columns_their_rows_use():
    """Each micro-batch is trimmed to its rows' first real prompt column and last loss token (loss holes of tool
    replies before it kept), checked against a column-by-column scan of each slice."""
    import torch

    from lora_grpo.batch import Batch

    g = torch.Generator().manual_seed(0)
    N, P, T = 10, 7, 9
    starts, ends = torch.randint(0, P, (N,), generator=g), torch.randint(0, T + 1, (N,), generator=g)
    attention = (torch.arange(P + T) >= starts[:, None]).long()  # left padding
    completion = (torch.arange(T) < ends[:, None]).float() * (torch.rand(N, T, generator=g) > 0.2)
    completion[3] = 0  # a row with no loss token
    batch = Batch(
        input_ids=torch.arange(N * (P + T)).view(N, P + T),
        attention_mask=attention,
        completion_mask=completion,
        advantages=torch.randn(N, generator=g),
        old_logp=None,
        ref_logp=None,
    )
    for size in (1, 3, 4, 10):
        for i, mb in enumerate(batch.micro_batches(size)):
            rows = slice(i * size, (i + 1) * size)
            first = next(c for c in range(P) if attention[rows, c].any())
            used = [c for c in range(T) if completion[rows, c].any()]
            t = used[-1] + 1 if used else 1
            assert mb.completion_length == t
            assert torch.equal(mb.input_ids, batch.input_ids[rows, first : P + t])
            assert torch.equal(mb.completion_mask, completion[rows, :t])
