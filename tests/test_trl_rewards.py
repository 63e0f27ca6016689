"""Reward functions written for TRL's GRPOTrainer work unchanged (CPU, offline, tiny model).

The functions below are written out here in the signatures TRL documents (its GRPO trainer docs'
"Using a custom reward function" examples, its quickstart, and trl.rewards), not imported: TRL is
no dependency. Each trains one step through GRPOTrainer, on a plain-text dataset and on a
conversational one (prompts as chat messages, the TRL conversational format).
"""

import re

import pytest

from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.rewards import compute_rewards

G = 4  # num_generations

# ------------------------------------------------------------------ standard (text) format


def reward_len(completions, **kwargs):
    """TRL quickstart: prefer completions of about 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def reward_num_tokens(completion_ids, **kwargs):
    """TRL docs example 1 (its text spells the parameter `completions_ids`; the trainer passes
    `completion_ids`, as here)."""
    return [float(len(ids)) for ids in completion_ids]


def boxed_ground_truth(completions, ground_truth, **kwargs):
    """TRL docs example 3: the content of \\boxed{} equals the `ground_truth` column."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    """TRL docs example 4 (multi-task): None where the reward does not apply."""
    return [(1.0 if "2" in str(c) else -1.0) if t == "math" else None for c, t in zip(completions, task)]


# ---------------------------------------------------------------------- conversational format


def format_reward_func(completions, **kwargs):
    """TRL docs example 2 (conversational): reads completion[0]["content"]."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in completion_contents]


def think_format_reward(completions, **kwargs):
    """trl.rewards.think_format_reward's signature and access pattern."""
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.DOTALL) else 0.0 for content in contents]


def accuracy_reward(completions, solution, **kwargs):
    """trl.rewards.accuracy_reward's signature and access pattern (text comparison instead of
    math_verify); None where the solution is empty, as TRL's."""
    contents = [completion[0]["content"] for completion in completions]
    return [None if not sol else float(c.strip() == sol) for c, sol in zip(contents, solution)]


def soft_overlong_punishment_reward(completion_ids, **kwargs):
    """trl.rewards.get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2)'s reward."""
    rewards = []
    for ids in completion_ids:
        completion_length = len(ids)
        if completion_length <= 6 - 2:
            rewards.append(0.0)
        elif 6 - 2 < completion_length <= 6:
            rewards.append((6 - 2 - completion_length) / 2)
        else:
            rewards.append(-1.0)
    return rewards


def prompt_and_ids_reward(prompts, completions, completion_ids, **kwargs):
    """Uses prompts and completion_ids: the last prompt message's length, per completion token."""
    return [len(p[-1]["content"]) / max(1, len(ids)) for p, ids in zip(prompts, completion_ids)]


def curriculum_reward(completions, trainer_state, **kwargs):
    """Reward shaping over training progress, as TRL documents trainer_state for."""
    return [min(1.0, trainer_state.global_step / max(1, trainer_state.max_steps))] * len(completions)


# ---------------------------------------------------------------------------------- harness

PLAIN = [
    {"prompt": f"{i}+{i % 3}=", "ground_truth": str(i + i % 3), "task": ["math", "code"][i % 2]}
    for i in range(8)
]
CHAT = [
    {
        "prompt": [{"role": "user", "content": f"{i}+{i % 3}="}],
        "solution": str(i + i % 3) if i % 4 else "",
        "task": ["math", "code"][i % 2],
    }
    for i in range(8)
]


class Spy:
    """A reward function (``fn(**kwargs)``) that records every call's keywords; rewards 0."""

    __name__ = "spy"

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        state = kwargs["trainer_state"]  # the live state, as TRL passes it: keep what it said at the call
        self.calls.append({**kwargs, "state_then": (state.global_step, state.max_steps, state.epoch)})
        return [0.0] * len(kwargs["completions"])


def train_one_step(tiny_base_dir, tmp_path, reward_funcs, dataset):
    config = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        lora_r=4,
        lora_alpha=8,
        num_generations=G,
        prompts_per_step=2,
        max_completion_length=6,
        micro_batch_size=8,
        max_steps=1,
        beta=0.0,
        learning_rate=1e-3,
        output_dir=str(tmp_path / "run"),
        save_steps=0,
        seed=0,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(config, reward_funcs=reward_funcs, train_dataset=dataset)
    trainer.train()
    return trainer


def check_common_keywords(call, dataset_rows):
    """The keywords every reward function gets, as TRL passes them (plus ours)."""
    n = len(call["completions"])
    assert n == 2 * G
    assert len(call["prompts"]) == len(call["completion_ids"]) == n
    assert call["completion_lengths"] == [len(ids) for ids in call["completion_ids"]]
    assert all(isinstance(t, int) for ids in call["completion_ids"] for t in ids)
    assert len(call["truncated"]) == n and all(isinstance(t, bool) for t in call["truncated"])
    from transformers import TrainerState

    assert isinstance(call["trainer_state"], TrainerState) and call["state_then"] == (0, 1, 0.0)
    assert callable(call["log_extra"]) and callable(call["log_metric"])  # TRL's logging callables
    # A prompt's row repeats for its G completions, groups contiguous; "prompt" is never a keyword.
    assert "prompt" not in call and "prompt_messages" not in call
    for column in set(dataset_rows[0]) - {"prompt"}:
        values = call[column]
        assert len(values) == n
        assert all(values[g * G : (g + 1) * G] == [values[g * G]] * G for g in range(2))


# ------------------------------------------------------------------------------------ tests


def test_trl_signatures_train_on_plain_text_data(tiny_base_dir, tmp_path):
    spy = Spy()
    funcs = [reward_len, reward_num_tokens, boxed_ground_truth, math_reward_func, curriculum_reward, spy]
    trainer = train_one_step(tiny_base_dir, tmp_path, funcs, PLAIN)
    (call,) = spy.calls
    check_common_keywords(call, PLAIN)
    assert all(isinstance(p, str) and re.fullmatch(r"\d+\+\d=", p) for p in call["prompts"])
    assert all(isinstance(c, str) for c in call["completions"])
    assert set(call) == {
        "prompts",
        "completions",
        "completion_ids",
        "completion_lengths",
        "truncated",
        "trainer_state",
        "log_extra",
        "log_metric",
        "ground_truth",
        "task",
        "state_then",
    }
    metrics = trainer.state.log_history[0]
    for fn in funcs:
        assert f"rewards/{fn.__name__}/mean" in metrics, fn.__name__
    assert metrics["rewards/reward_num_tokens/mean"] == pytest.approx(metrics["completion_length/mean"])


def test_trl_signatures_train_on_conversational_data(tiny_base_dir, tmp_path):
    spy = Spy()
    funcs = [
        format_reward_func,
        think_format_reward,
        accuracy_reward,
        soft_overlong_punishment_reward,
        prompt_and_ids_reward,
        math_reward_func,
        reward_len,
        spy,
    ]
    trainer = train_one_step(tiny_base_dir, tmp_path, funcs, CHAT)
    (call,) = spy.calls
    check_common_keywords(call, CHAT)
    # TRL's conversational format: prompts are the message lists, completions one assistant message.
    rows_by_prompt = {row["prompt"][0]["content"]: row for row in CHAT}
    for prompt, completion, solution in zip(call["prompts"], call["completions"], call["solution"]):
        assert prompt == [{"role": "user", "content": prompt[0]["content"]}]
        assert rows_by_prompt[prompt[0]["content"]]["solution"] == solution
        assert isinstance(completion, list) and len(completion) == 1
        assert set(completion[0]) == {"role", "content"} and completion[0]["role"] == "assistant"
        assert isinstance(completion[0]["content"], str)
    metrics = trainer.state.log_history[0]
    for fn in funcs:
        assert f"rewards/{fn.__name__}/mean" in metrics, fn.__name__
    assert (
        metrics["rewards/reward_len/mean"] == -19.0
    )  # len([message]) == 1: TRL's quickstart reward is for text


def test_trl_signatures_by_keyword_without_a_trainer():
    """The same functions through compute_rewards, with TRL's own doc examples' inputs."""
    chat_completions = [
        [{"role": "assistant", "content": "<think>1 + 2 is 3, times 4 is 12.</think><answer>12</answer>"}],
        [{"role": "assistant", "content": "3 + 1 is 4, so 8."}],
    ]
    _, per_func, _ = compute_rewards(
        [format_reward_func, think_format_reward, accuracy_reward, soft_overlong_punishment_reward],
        [
            [{"role": "user", "content": "What is (1 + 2) * 4?"}],
            [{"role": "user", "content": "(3 + 1) * 2?"}],
        ],
        chat_completions,
        {"solution": ["x", ""], "completion_ids": [[1, 2, 3], [1, 2, 3, 4, 5]]},
    )
    assert per_func[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert per_func[1, :2].tolist() == [0.0, 0.0] and per_func[1, 2].isnan()  # None: no solution
    assert per_func[1, 3].item() == -0.5
    _, per_func, _ = compute_rewards(
        [reward_len, reward_num_tokens, boxed_ground_truth],
        ["Solve $2x + 3 = 7$.", "Solve $3x - 5 = 10$."],
        [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."],
        {"ground_truth": ["2", "5"], "completion_ids": [[6303, 13], [304, 279, 12884, 13]]},
    )
    assert per_func.tolist() == [[-7.0, 2.0, 1.0], [-7.0, 4.0, 0.0]]  # 27 characters each


def test_messages_column_with_system_prompt_reaches_rewards_once_as_prompts(tiny_base_dir, tmp_path):
    spy = Spy()
    rows = [{"messages": row["prompt"], "solution": row["solution"]} for row in CHAT]
    config = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        lora_r=4,
        num_generations=G,
        prompts_per_step=2,
        max_completion_length=4,
        micro_batch_size=8,
        max_steps=1,
        beta=0.0,
        output_dir=str(tmp_path / "run"),
        save_steps=0,
        system_prompt="Be brief.",
        eval_steps=0,
        max_prompt_length=64,
    )
    trainer = GRPOTrainer(
        config, reward_funcs=[accuracy_reward, spy], train_dataset=rows, eval_dataset=rows[:3]
    )
    trainer.train()
    train_call, eval_calls = (
        spy.calls[1],
        spy.calls[:1] + spy.calls[2:],
    )  # eval before, train step, eval after
    assert len(train_call["completions"]) == 2 * G and [len(c["completions"]) for c in eval_calls] == [3, 3]
    for call in spy.calls:
        assert "messages" not in call and "prompt_messages" not in call  # only as `prompts`
        for prompt, completion in zip(call["prompts"], call["completions"]):
            assert prompt[0] == {"role": "system", "content": "Be brief."} and prompt[1]["role"] == "user"
            assert completion[0]["role"] == "assistant"
    assert eval_calls[1]["trainer_state"].global_step == 1  # after the step
    assert "eval/accuracy_reward" in trainer.evaluate()


# ------------------------------------------------------------------ TRL's registry names score as TRL's


@pytest.mark.parametrize("name", ["accuracy_reward", "reasoning_accuracy_reward"])
def test_trls_registry_rewards_score_as_trls_own(name):
    """A `trl grpo` recipe's reward_funcs: [accuracy_reward] must train on TRL's signal: the same scores as
    trl.rewards' function on answers it reads differently from lora_grpo's lenient answer_accuracy (a bare
    number, $3$, an equation, an answer inside the reasoning, a solution that does not parse)."""
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    from lora_grpo.rewards import BUILTIN_REWARDS

    texts = [
        r"it is \boxed{\frac{1}{3}}",
        r"\boxed{1/2}",
        "3",
        "$3$",
        "x = 3",
        r"<think>\boxed{4}</think> \boxed{3}",
        r"<think>so</think> \(3\)",
        "<think>x</think> the answer is 3",
        r"<think>unfinished \boxed{3}",
        r"\boxed{3}",
    ]
    solution = ["1/3", "1/3", "3", "3", "3", "3", "3", "3", "3", "no answer here"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    from lora_grpo.trl.script import reward_registry

    ours, _ = BUILTIN_REWARDS[name]
    theirs = getattr(trl_rewards, name)(completions, solution)
    assert ours(completions=completions, solution=solution) == theirs
    # the name in a `lora-grpo trl` recipe too (its registry of TRL's names)
    assert reward_registry()[name](completions=completions, solution=solution) == theirs
    assert len(set(map(str, theirs))) > 1  # the table tells scores apart
    extra = {}
    ours(
        completions=completions,
        solution=solution,
        log_extra=lambda column, values: extra.update({column: values}),
    )
    assert set(extra) == {"solution", "gold_parsed", "answer_parsed"}


@pytest.mark.parametrize("name", ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"])
def test_trls_named_rewards_read_a_tool_runs_first_assistant_turn_as_trl_does(name):
    """In a tool run a completion is several messages (a call, the tool's reply, a final turn); TRL's built-ins
    read the first. lora_grpo's read the last, so a TRL recipe with tools trained on other rewards (found in
    review)."""
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    from lora_grpo.rewards import BUILTIN_REWARDS

    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    completions = [
        [
            {"role": "assistant", "content": first, "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": "3"},
            {"role": "assistant", "content": last},
        ]
        for first, last in [
            ("<think>need calc</think>", r"The answer is \boxed{3}"),
            (r"<think>so</think> \boxed{3}", "<think>done</think>"),
        ]
    ]
    ours, _ = BUILTIN_REWARDS[name]
    keywords = {} if name == "think_format_reward" else {"solution": ["3", "3"]}
    theirs = getattr(trl_rewards, name)(completions, **keywords)
    assert ours(completions=completions, **keywords) == theirs
