"""Issue 17's faults end to end, through make_trainer(...).train(): what a user who meets each one
sees (the message, whether the run stops, what is kept on disk). The pieces have their own tests
(test_startup, test_data, test_rewards' contract, test_health, test_run_dir)."""

import math

import datasets
import pytest
from conftest import PROMPTS, SMALL_RUN, digit_share, make_trainer

from lora_grpo.rewards.scoring import RewardFunctionError, compute_rewards

# A plain, quick run: 2 prompts × 2 completions of 4 tokens per step, fp32.
QUICK = {k: v for k, v in SMALL_RUN.items() if k != "train_dataset"}


# ----------------------------------------------------------------------------- reward functions at run time


def _failing_from(step: int, failure):
    """A reward that works until `step` optimizer steps are done, then fails as `failure(completions)` says."""

    def flaky_reward(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= step:
            return failure(completions)
        return [float(len(c)) for c in completions]

    return flaky_reward


def _raises(completions):
    raise KeyError("score")


@pytest.mark.parametrize(
    "failure, message",
    [
        (_raises, r"reward function 'flaky_reward' raised KeyError: 'score'; first failing sample 0"),
        (
            lambda c: [1.0] * (len(c) - 1),
            r"reward function 'flaky_reward' returned 3 values for 4 completions",
        ),
        (
            lambda c: [1.0] * (len(c) + 2),
            r"reward function 'flaky_reward' returned 6 values for 4 completions",
        ),
        (
            lambda c: [math.nan] * len(c),
            r"reward function 'flaky_reward' returned NaN for every one of the 4 completions",
        ),
    ],
)
def test_a_reward_function_failing_at_step_1_names_itself_and_the_step(
    tiny_base_dir, tmp_path, failure, message
):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **QUICK,
        max_steps=3,
        save_steps=1,
        reward_funcs=[_failing_from(0, failure)],
        train_dataset=PROMPTS[:8],
    )
    with pytest.raises(
        RewardFunctionError,
        match=r"^step 1/3 stopped: after 0 of 3 optimizer steps: "
        + message
        + r".*nothing was trained yet; fix the function",
    ) as info:
        trainer.train()
    assert info.value.function == "flaky_reward" and info.value.global_step == 0
    assert isinstance(info.value, RuntimeError) and isinstance(
        info.value, ValueError
    )  # either except catches it
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # nothing trained, nothing to keep


@pytest.mark.parametrize("front_door", ["native", "trl"])
def test_reward_bisect_on_error_off_calls_a_failing_reward_once_and_names_it(
    tiny_base_dir, tmp_path, front_door
):
    calls = []

    def remote_reward(completions, **kwargs):
        calls.append(len(completions))
        raise TimeoutError("the scoring service did not answer")

    if front_door == "native":
        trainer = make_trainer(
            tiny_base_dir,
            tmp_path,
            **QUICK,
            max_steps=2,
            reward_funcs=[remote_reward],
            train_dataset=PROMPTS[:8],
            reward_bisect_on_error=False,
        )
    else:
        from lora_grpo.trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            output_dir=str(tmp_path / "run"),
            use_cpu=True,
            max_steps=2,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
            reward_bisect_on_error=False,
        )
        trainer = GRPOTrainer(
            model=tiny_base_dir,
            reward_funcs=remote_reward,
            args=args,
            train_dataset=datasets.Dataset.from_list(PROMPTS[:8]),
        )
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function 'remote_reward' raised TimeoutError: the scoring service did not answer on the "
        r"batch of 4 completions \(not called again per sample: reward_bisect_on_error=false\)",
    ) as info:
        trainer.train()
    assert info.value.function == "remote_reward"
    assert calls == [4]  # one call for the step's batch; none per sample


def test_a_reward_function_failing_after_hours_keeps_the_last_checkpoint_to_resume_from(
    tiny_base_dir, tmp_path
):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **QUICK,
        max_steps=4,
        save_steps=1,
        save_total_limit=5,
        reward_funcs=[_failing_from(2, _raises)],
        train_dataset=PROMPTS[:8],
    )
    with pytest.raises(
        RewardFunctionError,
        match=r"^step 3/4 stopped: after 2 of 4 optimizer steps: reward function 'flaky_reward' raised.*"
        r"checkpoint written to .*checkpoint-2; fix the function, then resume: .*resume_from_checkpoint='latest'",
    ):
        trainer.train()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # With the function fixed, the run continues from there.
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path,
        **QUICK,
        max_steps=4,
        reward_funcs=[_failing_from(99, _raises)],
        train_dataset=PROMPTS[:8],
        resume_from_checkpoint="latest",
    )
    assert resumed.train()["steps"] == 4


def test_none_for_every_completion_is_does_not_apply_not_an_error():
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    _, per_func, metrics = compute_rewards([not_applicable, digit_share], ["p", "q"], ["1", "a"], {})
    assert math.isnan(
        metrics["rewards/not_applicable/mean"]
    )  # run/health.py flags it: health/reward_none/...
    assert per_func[:, 1].tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- datasets


@pytest.mark.parametrize(
    "train, eval_, message",
    [
        (
            datasets.Dataset.from_dict({"prompt": []}),
            None,
            r"^train_dataset: the prompt dataset from Dataset is empty",
        ),
        (PROMPTS[:1], None, r"the train dataset has 1 rows .*fewer than one batch of prompts_per_step=2"),
        (
            [{"question": "1+1"}] * 4,
            None,
            r"^train_dataset: cannot find the prompts: no column 'prompt'.*prompt_template",
        ),
        (
            [{"messages": [{"content": "hi"}]}] * 4,
            None,
            r"^train_dataset: column 'messages'.*its message 0 has no 'role'",
        ),
        (PROMPTS, [], r"^eval_dataset: .* is empty.*leave eval_dataset unset to train without evaluation"),
    ],
)
def test_a_faulty_dataset_stops_the_run_at_start_naming_it(tiny_base_dir, tmp_path, train, eval_, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tiny_base_dir, tmp_path, **QUICK, max_steps=2, train_dataset=train, eval_dataset=eval_)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_streamed_dataset_trains_with_max_steps(tiny_base_dir, tmp_path):
    stream = datasets.Dataset.from_list(PROMPTS).to_iterable_dataset()  # TRL accepts one with max_steps
    trainer = make_trainer(tiny_base_dir, tmp_path, **QUICK, max_steps=2, train_dataset=stream)
    assert len(trainer.train_dataset) == 4  # 2 steps × 2 prompts, read once at start
    assert trainer.train()["steps"] == 2
    with pytest.raises(ValueError, match=r"streamed IterableDataset, which has no length.*set max_steps"):
        make_trainer(tiny_base_dir, tmp_path, **QUICK, max_steps=0, train_dataset=stream)


# ----------------------------------------------------------------------------- model set-up


def test_target_modules_that_match_nothing_and_a_reward_path_that_does_not_import(tiny_base_dir, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"lora_target_modules entry 'q_prj' matches no module of this model; closest: "
        r"'q_proj'",
    ):
        make_trainer(tiny_base_dir, tmp_path, **QUICK, lora_target_modules=["q_prj", "v_proj"])
    with pytest.raises(
        ValueError,
        match=r"cannot import reward 'my_rewardz\.mod:fn'.*'my_rewardz' is not importable "
        r"from here.*run from the directory that holds my_rewardz/ or my_rewardz\.py",
    ):
        make_trainer(tiny_base_dir, tmp_path, **QUICK, reward_funcs=["my_rewardz.mod:fn"])


# ----------------------------------------------------------------------------- resume edge cases


def test_a_resume_whose_dataset_changed_length_says_what_happened(tiny_base_dir, tmp_path):
    make_trainer(
        tiny_base_dir, tmp_path, **QUICK, max_steps=2, save_steps=1, train_dataset=PROMPTS[:8]
    ).train()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path,
        **QUICK,
        max_steps=4,
        train_dataset=PROMPTS[:10],
        resume_from_checkpoint="latest",
    )
    with pytest.raises(
        ValueError,
        match=r"cannot resume: the checkpoint's run drew its prompts from 8 rows, this run's "
        r"train dataset has 10.*Resume with the same dataset.*init_adapter=",
    ):
        resumed.train()
