"""Reward contract, built-in rewards, resolution from specs, and weighted scoring (CPU, no model)."""

import ast
import functools
import inspect
import math
import statistics
import textwrap

import numpy as np
import pytest
import torch
from helpers import make_trainer

from lora_grpo import rewards as R
from lora_grpo.rewards import (
    answer_accuracy,
    check_reward_columns,
    compute_rewards,
    length_penalty,
    parse_number,
    resolve_reward_funcs,
    reward_name,
    soft_overlong_penalty,
    think_answer_format,
)
from lora_grpo.rewards import builtins as reward_builtins
from lora_grpo.rewards import specs as reward_specs


def _q(n):
    return ["q"] * n


# ----------------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>4</answer>", 0.0),  # no think block
        ("<think>x</think>", 0.0),  # no answer block
        ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
        ("Sure! <think>x</think><answer>4</answer>", 0.0),  # text before
        ("<think>x</think><answer>4</answer> done", 0.0),  # text after
        ("<think>x</think>between<answer>4</answer>", 0.0),  # text between
        ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),  # two answers
        ("<think>a<think>b</think><answer>4</answer>", 0.0),  # nested tag
    ],
)
def test_think_answer_format(completion, expected):
    assert think_answer_format(completions=[completion]) == [expected]


def test_format_accepts_extra_kwargs_and_conversational_completions():
    got = think_answer_format(
        prompts=_q(2),
        completions=[
            "<think>a</think><answer>b</answer>",
            [{"role": "assistant", "content": "<answer>b</answer>"}],
        ],
        answer=["x", "y"],
        completion_lengths=[3, 4],
        truncated=[False, False],
    )
    assert got == [1.0, 0.0]


# ----------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42),
        ("-7", -7),
        ("+3", 3),
        ("3.50", "7/2"),
        (".5", "1/2"),
        ("-0.25", "-1/4"),
        ("1,234", 1234),
        ("1,234,567.5", "2469135/2"),
        ("3/4", "3/4"),
        ("-3 / 4", "-3/4"),
        ("\\frac{3}{4}", "3/4"),
        ("-\\dfrac{1}{2}", "-1/2"),
        ("\\boxed{12}", 12),
        ("\\boxed{\\frac{1}{3}}", "1/3"),
        ("$\\boxed{7}$", 7),
        ("18.", 18),
        ("50%", 50),
        ("50\\%", 50),
        ("$1,000", 1000),
        ("1{,}000", 1000),
    ],
)
def test_parse_number(text, expected):
    from fractions import Fraction

    assert parse_number(text) == Fraction(expected)


@pytest.mark.parametrize("text", ["", "abc", "4 apples", "1/0", "1,23", "x^2", "\\boxed{1}+\\boxed{2}"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>maybe 3</think><answer> 5 </answer>", "5"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("so the result is \\boxed{\\frac{1}{2}} since 9", "\\frac{1}{2}"),
        ("first 3, then 4.5, finally -12.", "-12"),
        ("the ratio is 3/4", "3/4"),
        ("we get 1,234 apples", "1,234"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text, expected):
    assert R.extract_answer(text) == expected


# ---------------------------------------------------------------------------------- accuracy

# (completion, reference, expected) that hold with and without math_verify.
ACCURACY_CASES = [
    ("<think>..</think><answer>42</answer>", "42", 1.0),
    ("<think>..</think><answer>41</answer>", "42", 0.0),
    ("<answer>1,234</answer>", "1234", 1.0),
    ("<answer>0.75</answer>", "3/4", 1.0),
    ("<answer>\\frac{3}{4}</answer>", "0.75", 1.0),
    ("<answer>-5.0</answer>", "-5", 1.0),
    ("<answer>The answer is 18.</answer>", "18", 1.0),  # a sentence around one number inside the tag
    ("<answer>it is 1,234 apples</answer>", "1234", 1.0),
    ("<answer>y = 3</answer>", "3", 1.0),
    # several numbers, or an expression, inside the tag are not the number they contain: hedging scores nothing
    ("<answer>3 or 4</answer>", "4", 0.0),
    ("<answer>1, 2, 3, 4, 5</answer>", "5", 0.0),
    ("<answer>3x</answer>", "3", 0.0),
    ("<answer>x^2</answer>", "2", 0.0),
    ("<answer>x+1</answer>", "1", 0.0),
    ("<answer>sqrt(2)</answer>", "2", 0.0),
    ("I think it is 3, no, 7.", "7", 1.0),  # no tag: last number
    ("I think it is 7, no, 3.", "7", 0.0),
    ("so \\boxed{12} apples, 5 left", "12", 1.0),  # no tag: last \boxed wins over the last number
    ("no answer at all", "7", 0.0),
    ("<answer>72</answer>", "Natalia sold 48/2 = 24 clips... 48+24 = 72\n#### 72", 1.0),  # GSM8K
]


@pytest.fixture(params=["fallback", "math_verify"])
def accuracy_backend(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(reward_builtins, "_math_verify", None)
    else:
        monkeypatch.setattr(reward_builtins, "_math_verify", pytest.importorskip("math_verify"))
    return request.param


@pytest.mark.parametrize("completion, reference, expected", ACCURACY_CASES)
def test_answer_accuracy(accuracy_backend, completion, reference, expected):
    assert answer_accuracy(completions=[completion], answer=[reference]) == [expected]


def test_answer_accuracy_text_answers(accuracy_backend):
    got = answer_accuracy(
        completions=["<answer> Paris </answer>", "<answer>paris.</answer>", "<answer>Lyon</answer>"],
        answer=["Paris", "Paris", "Paris"],
    )
    assert got == [1.0, 1.0, 0.0]


def test_answer_accuracy_math_verify_symbolic(monkeypatch):
    monkeypatch.setattr(reward_builtins, "_math_verify", pytest.importorskip("math_verify"))
    got = answer_accuracy(
        completions=["<answer>1+x^2</answer>", "<answer>x^2-1</answer>"], answer=["x^2+1"] * 2
    )
    assert got == [1.0, 0.0]


def test_answer_accuracy_none_without_reference_and_solution_column(monkeypatch):
    monkeypatch.setattr(reward_builtins, "_math_verify", None)
    got = answer_accuracy(completions=["<answer>4</answer>"] * 3, answer=["4", None, "  "])
    assert got == [1.0, None, None]
    assert answer_accuracy(
        completions=[[{"role": "assistant", "content": "<answer>4</answer>"}]], solution=["#### 4"]
    ) == [1.0]
    with pytest.raises(ValueError, match="'answer'.*'solution'"):
        answer_accuracy(completions=["4"], question=["q"])


# ---------------------------------------------------------------------------- length penalties


def test_soft_overlong_penalty_three_regions():
    # DAPO eq. 13 with Lmax = 100, Lcache = 20: free up to 80, linear to -1 at 100, -1 beyond.
    fn = soft_overlong_penalty(max_completion_length=100, buffer_length=20)
    lengths = [0, 79, 80, 81, 90, 95, 100, 101, 500]
    got = fn(completions=[""] * 9, completion_lengths=lengths)
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -0.75, -1.0, -1.0, -1.0])
    assert got[2] == 0.0 and got[6] == -1.0  # both boundaries exact
    assert reward_name(fn) == "soft_overlong_penalty"


def test_soft_overlong_penalty_validation():
    with pytest.raises(ValueError, match="buffer_length"):
        soft_overlong_penalty(max_completion_length=10, buffer_length=20)
    with pytest.raises(ValueError, match="buffer_length"):
        soft_overlong_penalty(max_completion_length=10, buffer_length=0)
    with pytest.raises(ValueError, match="completion_lengths"):
        soft_overlong_penalty(10, 5)(completions=["c"])
    # Without completion_lengths, the lengths of completion_ids (as TRL's soft overlong punishment).
    assert soft_overlong_penalty(10, 5)(completions=["a", "b"], completion_ids=[[1] * 5, [1] * 10]) == [
        0.0,
        -1.0,
    ]


def test_length_penalty():
    fn = length_penalty(target_length=50, scale=0.5)
    got = fn(completions=[""] * 5, completion_lengths=[0, 50, 51, 100, 150])
    assert got == pytest.approx([0.0, 0.0, -0.01, -0.5, -1.0])
    assert reward_name(fn) == "length_penalty"
    with pytest.raises(ValueError, match="target_length"):
        length_penalty(target_length=0)


# ----------------------------------------------------------------------------------- resolve


def test_resolve_builtin_names_and_aliases():
    fmt, acc, fmt2 = resolve_reward_funcs(["format", "accuracy", "think_answer_format"])
    assert fmt is think_answer_format and acc is answer_accuracy and fmt2 is think_answer_format


def test_resolve_factories_with_kwargs_and_context():
    (fn,) = resolve_reward_funcs(
        [{"name": "soft_overlong", "kwargs": {"max_completion_length": 10, "buffer_length": 4}}]
    )
    assert fn(completions=["", ""], completion_lengths=[6, 8]) == pytest.approx([0.0, -0.5])
    # max_completion_length from the trainer's context; explicit kwargs win over context.
    (fn,) = resolve_reward_funcs(
        {"name": "soft_overlong", "kwargs": {"buffer_length": 4}},
        context={"max_completion_length": 10, "seed": 0},
    )
    assert fn(completions=[""], completion_lengths=[8]) == pytest.approx([-0.5])
    (fn,) = resolve_reward_funcs(
        [{"name": "length", "kwargs": {"target_length": 10}}], context={"target_length": 99}
    )
    assert fn(completions=[""], completion_lengths=[20]) == [-1.0]


def test_resolve_factory_missing_kwargs_is_clear():
    with pytest.raises(ValueError, match=r"soft_overlong.*buffer_length"):
        resolve_reward_funcs(["soft_overlong"], context={"max_completion_length": 10})


def test_resolve_callables_pass_through():
    def mine(prompts, completions, **kw):
        return [1.0] * len(completions)

    assert resolve_reward_funcs([mine]) == [mine]
    assert resolve_reward_funcs(mine) == [mine]


def test_resolve_dotted_paths_stdlib():
    import os.path

    assert resolve_reward_funcs(["os.path:basename", "os.path.basename"]) == [os.path.basename] * 2


def test_resolve_dotted_paths_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def brevity(prompts, completions, **kw):
                return [-len(c) / 10 for c in completions]

            def make_bonus(value):
                def bonus(prompts, completions, **kw):
                    return [value] * len(completions)
                return bonus

            class Exact:
                def __init__(self, target="ok"):
                    self.target = target
                def __call__(self, prompts, completions, **kw):
                    return [float(c == self.target) for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fns = resolve_reward_funcs(
        [
            "my_rewards_mod:brevity",
            "my_rewards_mod.brevity",
            {"name": "my_rewards_mod:make_bonus", "kwargs": {"value": 2.0}},
            "my_rewards_mod:Exact",
            {"name": "my_rewards_mod.Exact", "kwargs": {"target": "yes"}},
        ]
    )
    outs = [fn(prompts=_q(2), completions=["ok", "yes"]) for fn in fns]
    assert outs == [[-0.2, -0.3], [-0.2, -0.3], [2.0, 2.0], [1.0, 0.0], [0.0, 1.0]]
    assert [reward_name(f) for f in fns] == ["brevity", "brevity", "bonus", "Exact", "Exact"]


def test_resolve_errors_name_the_spec():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*built-in name"):
        resolve_reward_funcs(["nope"])
    with pytest.raises(ValueError, match=r"cannot import reward 'no_such_pkg_xyz\.mod:fn'.*accepted"):
        resolve_reward_funcs(["no_such_pkg_xyz.mod:fn"])
    with pytest.raises(ValueError, match=r"cannot import reward 'os\.path:no_such_fn'"):
        resolve_reward_funcs(["os.path:no_such_fn"])
    with pytest.raises(ValueError, match=r"os\.path\.no_such_fn"):
        resolve_reward_funcs(["os.path.no_such_fn"])
    with pytest.raises(ValueError, match="not valid"):
        resolve_reward_funcs([42])
    with pytest.raises(ValueError, match="'name'"):
        resolve_reward_funcs([{"kwargs": {}}])
    with pytest.raises(ValueError, match="takes no kwargs"):
        resolve_reward_funcs([{"name": "format", "kwargs": {"x": 1}}])
    # (an AttributeError or TypeError traceback before: found in review)
    for spec in (
        {"name": 5},
        {"name": "length", "kwargs": [100]},
        {"name": "length", "kwargs": "target_length=9"},
    ):
        with pytest.raises(
            ValueError, match=r"'name' must be text and 'kwargs' a mapping, e\.g\. \{name: length"
        ):
            resolve_reward_funcs([spec])
    with pytest.raises(ValueError, match="non-callable"):
        resolve_reward_funcs(["os:sep"])


def test_resolve_import_error_inside_user_module_is_reported(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="not_installed_dependency_xyz"):
        resolve_reward_funcs(["broken_rewards_mod.fn"])


def test_reward_name():
    def plain(prompts, completions, **kw):
        return []

    class Scorer:
        def __call__(self, prompts, completions, **kw):
            return []

    assert reward_name(plain) == "plain"
    assert reward_name(functools.partial(plain, extra=1)) == "plain"
    assert reward_name(functools.partial(functools.partial(plain), extra=1)) == "plain"
    assert reward_name(Scorer()) == "Scorer"


# ------------------------------------------------------------------------------ compute_rewards


def const(*values):
    def fn(prompts, completions, **kw):
        return list(values)

    return fn


def named(name, fn):
    fn.__name__ = name
    return fn


def test_compute_rewards_weighted_sum_and_none_handling():
    f = named("f", const(1.0, None, 0.0, None))
    g = named("g", const(2.0, -1.0, None, None))
    rewards, per_func, metrics = compute_rewards([f, g], _q(4), ["a", "b", "c", "d"], {}, weights=[1.0, 0.5])
    assert rewards.dtype == torch.float32 and rewards.shape == (4,)
    assert per_func.dtype == torch.float32 and per_func.shape == (4, 2)
    # Row 0: 1 + 0.5*2; row 1: None->0 + 0.5*(-1); row 2: 0 + None->0; row 3: all None -> NaN.
    assert rewards[:3].tolist() == [2.0, -0.5, 0.0]
    assert math.isnan(rewards[3])
    assert torch.equal(
        per_func.isnan(), torch.tensor([[False, False], [True, False], [False, True], [True, True]])
    )
    # Means leave None out (f over [1, 0], g over [2, -1]); the sample std (n - 1), as TRL's nanstd.
    assert metrics["rewards/f/mean"] == pytest.approx(0.5)
    assert metrics["rewards/f/std"] == pytest.approx(statistics.stdev([1.0, 0.0]))
    assert metrics["rewards/g/mean"] == pytest.approx(0.5)
    assert metrics["rewards/g/std"] == pytest.approx(statistics.stdev([2.0, -1.0]))
    assert metrics["reward/mean"] == pytest.approx(0.5)  # over the 3 non-NaN rewards
    assert metrics["reward/std"] == pytest.approx(statistics.stdev([2.0, -0.5, 0.0]))
    # one scored value has no sample std (TRL: NaN)
    _, _, one = compute_rewards([lambda completions, **kw: [1.0, None]], _q(2), ["a", "b"])
    assert (
        one["reward/mean"] == 1.0
        and math.isnan(one["reward/std"])
        and math.isnan(one["rewards/<lambda>/std"])
    )


def test_compute_rewards_default_weights_columns_and_value_types():
    seen = {}

    def spy(prompts, completions, **kw):
        seen.update(kw)
        return [True, 1, torch.tensor(0.5), float("nan")]  # bool, int, 0-d tensor, NaN (= None)

    rewards, per_func, metrics = compute_rewards(
        [spy, const(1.0, 1.0, 1.0, 1.0)],
        _q(4),
        list("abcd"),
        {"answer": list("wxyz"), "completion_lengths": [1, 2, 3, 4], "truncated": [False] * 4},
    )
    assert seen == {"answer": list("wxyz"), "completion_lengths": [1, 2, 3, 4], "truncated": [False] * 4}
    assert rewards.tolist() == [2.0, 2.0, 1.5, 1.0]
    assert math.isnan(per_func[3, 0])
    assert metrics["rewards/spy/mean"] == pytest.approx(2.5 / 3)


def test_compute_rewards_all_none_function_metrics_are_nan():
    _, _, metrics = compute_rewards(
        [named("f", const(None, None)), named("g", const(1.0, 3.0))], _q(2), ["a", "b"]
    )
    assert math.isnan(metrics["rewards/f/mean"]) and math.isnan(metrics["rewards/f/std"])
    assert metrics["rewards/g/mean"] == 2.0 and metrics["reward/mean"] == 2.0


def test_compute_rewards_duplicate_names_get_suffixes():
    f1, f2 = length_penalty(10), length_penalty(20)
    _, _, metrics = compute_rewards([f1, f2], ["q"], ["c"], {"completion_lengths": [30]})
    assert metrics["rewards/length_penalty/mean"] == -2.0
    assert metrics["rewards/length_penalty_2/mean"] == -0.5


def test_compute_rewards_with_builtins_end_to_end(monkeypatch):
    monkeypatch.setattr(reward_builtins, "_math_verify", None)
    funcs = resolve_reward_funcs(
        [
            "format",
            "accuracy",
            {"name": "soft_overlong", "kwargs": {"max_completion_length": 10, "buffer_length": 5}},
        ]
    )
    completions = ["<think>x</think><answer>4</answer>", "4", "<think>x</think><answer>5</answer>"]
    columns = {
        "answer": ["4", "4", None],
        "completion_lengths": [5, 1, 10],
        "truncated": [False, False, True],
    }
    rewards, per_func, metrics = compute_rewards(funcs, _q(3), completions, columns, weights=[0.5, 1.0, 1.0])
    assert rewards.tolist() == [1.5, 1.0, -0.5]
    assert metrics["rewards/answer_accuracy/mean"] == 1.0  # the None row is left out
    assert set(metrics) == {
        f"rewards/{n}/{s}"
        for n in ("think_answer_format", "answer_accuracy", "soft_overlong_penalty")
        for s in ("mean", "std")
    } | {"reward/mean", "reward/std"}


def test_compute_rewards_raising_function_names_function_and_sample():
    def picky(prompts, completions, **kw):
        return [1.0 / len(c) for c in completions]

    long_prompt = "P" * 1000
    with pytest.raises(RuntimeError) as info:
        compute_rewards([picky], ["q0", long_prompt], ["fine", ""], {})
    msg = str(info.value)
    assert "'picky'" in msg and "ZeroDivisionError" in msg
    assert "sample 1" in msg and "completion=''" in msg
    assert "P" * 200 in msg and "P" * 201 not in msg  # sample text truncated
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_compute_rewards_raising_only_on_batch():
    def batch_only(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("boom")
        return [0.0]

    with pytest.raises(RuntimeError, match=r"'batch_only'.*boom.*no single sample.*sample 0"):
        compute_rewards([batch_only], _q(2), ["a", "b"], {})


def test_a_failing_reward_is_called_again_per_sample_unless_bisect_on_error_is_off():
    calls = []

    def paid_judge(prompts, completions, **kw):
        calls.append(len(completions))
        if "b" in completions:
            raise ConnectionError("quota exceeded")
        return [1.0] * len(completions)

    with pytest.raises(
        RuntimeError, match=r"'paid_judge' raised ConnectionError: quota exceeded; first failing sample 1"
    ):
        compute_rewards([paid_judge], _q(4), ["a", "b", "c", "d"], {})
    assert calls == [4, 1, 1]  # the batch, then samples 0 and 1 alone: the second fails on its own
    calls.clear()
    with pytest.raises(RuntimeError) as info:
        compute_rewards([paid_judge], _q(4), ["a", "b", "c", "d"], {}, bisect_on_error=False)
    assert calls == [4]  # called exactly once
    assert str(info.value) == (
        "reward function 'paid_judge' raised ConnectionError: quota exceeded on the batch of 4 completions (not "
        "called again per sample: reward_bisect_on_error=false); first sample 0: prompt='q', completion='a'"
    )
    assert info.value.function == "paid_judge" and isinstance(info.value.__cause__, ConnectionError)


def test_compute_rewards_wrong_length():
    with pytest.raises(ValueError, match=r"'short'.*returned 1 values for 3 completions"):
        compute_rewards([named("short", const(1.0))], _q(3), ["a", "b", "c"], {})
    with pytest.raises(ValueError, match=r"'scalar'.*list of 2"):
        compute_rewards([named("scalar", lambda **kw: 1.0)], _q(2), ["a", "b"], {})


@pytest.mark.parametrize("bad", ["1.0", [1.0], float("inf"), {"r": 1}])
def test_compute_rewards_bad_value(bad):
    f = named("weird", const(0.0, bad))
    with pytest.raises(ValueError) as info:
        compute_rewards([f], ["p0", "the prompt"], ["c0", "the completion"], {})
    msg = str(info.value)
    assert "'weird'" in msg and "index 1" in msg
    assert "'the prompt'" in msg and "'the completion'" in msg


def test_compute_rewards_argument_errors():
    f = const(1.0)
    with pytest.raises(
        ValueError, match=r"Number of reward weights \(2\) must match number of reward functions \(1\)"
    ):
        compute_rewards([f], ["q"], ["c"], {}, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 1"):
        compute_rewards([f], ["q"], ["c"], {"answer": ["a", "b"]})
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        compute_rewards([f], ["q", "q"], ["c"], {})
    with pytest.raises(ValueError, match="'completions' clashes"):
        compute_rewards([f], ["q"], ["c"], {"completions": ["x"]})
    with pytest.raises(ValueError, match="at least one"):
        compute_rewards([], ["q"], ["c"], {})


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, 1.0),
        (False, 0.0),
        (3, 3.0),
        (np.float32(0.5), 0.5),
        (np.int64(2), 2.0),
        (np.bool_(True), 1.0),
        (np.bool_(False), 0.0),
        (np.float64("nan"), None),
        (torch.tensor(0.25), 0.25),
        (torch.tensor([0.75]), 0.75),
        (torch.tensor(True), 1.0),
        (np.array([1.5]), 1.5),
        (float("nan"), None),
    ],
)
def test_compute_rewards_value_types(value, expected):
    _, per_func, _ = compute_rewards([const(0.0, value)], _q(2), ["a", "b"])
    got = per_func[1, 0].item()
    assert math.isnan(got) if expected is None else got == expected


@pytest.mark.parametrize(
    "values",
    [torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), np.array([True, False]), torch.tensor([[1.0], [2.0]])],
)
def test_compute_rewards_whole_tensor_or_array_returned(values):
    _, per_func, _ = compute_rewards([lambda **kw: values], _q(2), ["a", "b"])
    assert per_func[:, 0].tolist() == [float(v) for v in np.asarray(values).reshape(-1)]


@pytest.mark.parametrize(
    "bad, words",
    [
        ("1.0", ["a str ('1.0')", "float(...)"]),
        (float("inf"), ["an infinite value (inf)", "clip"]),
        (np.float32("-inf"), ["an infinite value", "clip"]),
        (10**400, ["an infinite value"]),
        (1e39, ["beyond float32"]),
        (torch.tensor([1.0, 2.0]), ["a Tensor"]),
    ],
)
def test_compute_rewards_bad_value_names_function_index_sample_and_type(bad, words):
    with pytest.raises(ValueError) as info:
        compute_rewards([named("weird", const(0.0, bad))], ["p0", "the prompt"], ["c0", "the completion"])
    msg = str(info.value)
    assert "reward function 'weird' returned a bad value at index 1" in msg
    assert "sample 1: prompt='the prompt', completion='the completion'" in msg
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("bad", ["ab", {"a": 1.0, "b": 2.0}, np.array(1.0), 1.0])
def test_compute_rewards_non_list_return_value(bad):
    with pytest.raises(ValueError) as info:
        compute_rewards([named("whole", lambda **kw: bad)], _q(2), ["a", "b"])
    expected = (
        "reward function 'whole' must return a list of 2 numbers (one per completion), got a "
        f"{type(bad).__name__}"
    )
    assert expected in str(info.value)


# ------------------------------------------------------------------------------ column check


def accuracy_reward(completions, solution, **kwargs):  # TRL style: every argument by keyword
    return [float(c == s) for c, s in zip(completions, solution)]


def test_check_reward_columns_names_function_columns_and_dataset():
    with pytest.raises(ValueError) as info:
        funcs = [think_answer_format, accuracy_reward, answer_accuracy]
        check_reward_columns(funcs, ["prompt", "question"], "eval_dataset")
    msg = str(info.value)
    assert "eval_dataset lacks columns that reward functions need" in msg
    assert "reward function 'accuracy_reward' needs column 'solution'" in msg
    assert "reward function 'answer_accuracy' needs column 'answer' or 'solution'" in msg
    assert "think_answer_format" not in msg
    assert "eval_dataset has columns ['prompt', 'question']" in msg
    assert "rename_column" in msg and "default" in msg
    check_reward_columns([accuracy_reward, answer_accuracy], ["prompt", "solution"], "train_dataset")
    check_reward_columns([answer_accuracy], ["prompt", "answer"], "train_dataset")


def test_check_reward_columns_matches_every_parameter_by_name():
    def keyword_only(*, prompts, completions, completion_ids, answer, level=1, **kw): ...
    def uses_trainer_names(
        prompts, completions, completion_lengths, truncated, trainer_state, completion_ids
    ): ...
    def old_positional_style(p, c, answer, **kw): ...  # the first two are not prompts/completions any more

    class Scorer:
        required_columns = ("topic",)

        def __call__(self, completions, **kw): ...

    check_reward_columns(
        [uses_trainer_names, lambda **kw: [], accuracy_reward], ["solution"], "train_dataset"
    )
    for fn, column in [
        (keyword_only, "answer"),
        (Scorer(), "topic"),
        (old_positional_style, "p"),
        (functools.partial(accuracy_reward), "solution"),
        (soft_overlong_penalty(10, 5), None),
    ]:
        if column is None:
            check_reward_columns([fn], [], "train_dataset")
            continue
        with pytest.raises(
            ValueError, match=rf"needs column '{column}'.*train_dataset has columns \['prompt'\]"
        ):
            check_reward_columns([fn], ["prompt"], "train_dataset")
    with pytest.raises(ValueError) as info:
        check_reward_columns([old_positional_style], ["answer"], "train_dataset")
    msg = str(info.value)
    assert (
        "needs column 'p', 'c'" in msg
        and "every argument by keyword" in msg
        and "rename the parameter" in msg
    )


def test_check_reward_columns_hints_and_clashes():
    def docs_typo(
        completions_ids, **kwargs
    ): ...  # TRL's docs example spells it so; the trainer passes completion_ids

    with pytest.raises(
        ValueError, match=r"needs column 'completions_ids' \(did you mean 'completion_ids'\?\)"
    ):
        check_reward_columns([docs_typo], ["answer"], "train_dataset")
    with pytest.raises(ValueError, match=r"positional-only parameters \['completions'\]"):
        check_reward_columns([lambda completions, /, **kw: []], [], "train_dataset")
    with pytest.raises(
        ValueError, match=r"column\(s\) \['truncated'\], named like keywords the trainer passes"
    ):
        check_reward_columns([accuracy_reward], ["solution", "truncated"], "eval_dataset")
    check_reward_columns([functools.partial(accuracy_reward, solution=["x"])], [], "train_dataset")


# --------------------------------------------------------------------------- keyword contract


def test_compute_rewards_calls_every_function_by_keyword_only():
    seen = []

    def keyword_only(*, prompts, completions, **kw):
        seen.append((prompts, completions, sorted(kw)))
        return [1.0] * len(completions)

    def trl_accuracy(completions, solution, **kwargs):  # positionally this got "multiple values for solution"
        return [float(c == s) for c, s in zip(completions, solution)]

    def reward_len(completions, **kwargs):  # positionally, completions received the prompts
        return [float(len(c)) for c in completions]

    columns = {"solution": ["a", "x"], "completion_ids": [[1], [2, 3]], "trainer_state": "state"}
    _, per_func, _ = compute_rewards(
        [keyword_only, trl_accuracy, reward_len], ["p0", "p1"], ["a", "bb"], columns
    )
    assert seen == [(["p0", "p1"], ["a", "bb"], ["completion_ids", "solution", "trainer_state"])]
    assert per_func.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 2.0]]


def test_our_own_keywords_go_only_to_functions_that_can_take_them():
    """completion_lengths and truncated are not TRL's: a function written for TRL's keywords alone (no
    **kwargs) does not get them, also in the per-sample calls that name a failing sample; one that names
    them, or takes **kwargs, does."""
    got = {}

    def trl_exact(prompts, completions, completion_ids):
        got["exact"] = True
        return [1.0 / len(ids) for ids in completion_ids]

    def names_one(prompts, completions, completion_ids, truncated):
        got["one"] = truncated
        return [0.0] * len(completions)

    def takes_all(completions, **kwargs):
        got["all"] = sorted(kwargs)
        return [0.0] * len(completions)

    columns = {"completion_ids": [[1], [2, 3]], "completion_lengths": [1, 2], "truncated": [False, True]}
    compute_rewards([trl_exact, names_one, takes_all], ["p0", "p1"], ["a", "bb"], columns)
    assert got == {
        "exact": True,
        "one": [False, True],
        "all": ["completion_ids", "completion_lengths", "prompts", "truncated"],
    }
    columns["completion_ids"][1] = []  # the per-sample calls find sample 1, without a keyword error
    with pytest.raises(RuntimeError, match=r"'trl_exact'.*ZeroDivisionError.*sample 1"):
        compute_rewards([trl_exact], ["p0", "p1"], ["a", "bb"], columns)


def test_compute_rewards_passes_trainer_state_whole_also_per_sample():
    states = []

    def picky(completions, trainer_state, **kw):
        states.append(trainer_state)
        return [1.0 / len(c) for c in completions]

    from transformers import TrainerState

    state = TrainerState(global_step=3, max_steps=10, epoch=0.75)
    with pytest.raises(RuntimeError, match=r"'picky'.*ZeroDivisionError.*sample 1"):
        compute_rewards([picky], _q(2), ["ok", ""], {"trainer_state": state, "answer": ["1", "2"]})
    assert states == [state] * 3  # the batch call, then one call per sample: never sliced


def test_compute_rewards_signature_that_cannot_take_the_keywords():
    def old_style(p, c, **kw):
        return [0.0] * len(c)

    def no_kwargs(completions):
        return [0.0] * len(completions)

    with pytest.raises(ValueError) as info:
        compute_rewards([old_style], _q(1), ["c"], {"answer": ["4"]})
    msg = str(info.value)
    assert (
        "reward function 'old_style' cannot take the keywords" in msg
        and "missing a required argument: 'p'" in msg
    )
    assert "['p', 'c', 'kw']" in msg and "['answer', 'completions', 'prompts']" in msg
    assert "every argument is passed by keyword" in msg.lower() and "**kwargs" in msg
    with pytest.raises(
        ValueError, match=r"'no_kwargs' cannot take the keywords.*unexpected keyword argument 'prompts'"
    ):
        compute_rewards([no_kwargs], _q(1), ["c"])


def test_async_reward_functions_are_awaited_together():
    import asyncio

    events = {}

    # each needs the other to have started: only concurrent calls finish
    async def judge_a(completions, **kwargs):
        events.setdefault("a", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("b", asyncio.Event()).wait(), timeout=10)
        return [1.0] * len(completions)

    async def judge_b(completions, **kwargs):
        events.setdefault("b", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("a", asyncio.Event()).wait(), timeout=10)
        return [2.0] * len(completions)

    class AsyncScorer:
        async def __call__(self, completions, **kwargs):
            return [3.0] * len(completions)

    rewards, per_func, _ = compute_rewards(
        resolve_reward_funcs([judge_a, judge_b, AsyncScorer(), functools.partial(judge_a)])[:3],
        _q(2),
        ["c", "d"],
    )
    assert per_func.tolist() == [[1.0, 2.0, 3.0]] * 2 and rewards.tolist() == [6.0, 6.0]

    async def fails(completions, **kwargs):
        return [1.0 / len(c) for c in completions]

    with pytest.raises(RuntimeError, match=r"'fails' raised ZeroDivisionError.*first failing sample 1"):
        compute_rewards([fails], _q(2), ["ok", ""])


def test_async_rewards_and_tools_await_on_one_loop_that_outlives_every_step():
    """An LLM judge keeps a client or a semaphore between steps, bound to the loop of its first call: every
    step awaits on that same loop, still running, as in TRL; async tools share it, as TRL's do."""
    import asyncio

    from lora_grpo.rollout import Toolbox
    from lora_grpo.tasks import calculator

    loops, kept = [], {}

    async def judge(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        kept.setdefault("limit", asyncio.Semaphore(1))
        async with kept["limit"]:  # waits once a step: the semaphore is bound to its loop from then on
            await asyncio.sleep(0)
        return [1.0] * len(completions)

    for _ in range(3):  # three steps
        _, per_func, _ = compute_rewards([judge, judge], _q(2), ["c", "d"])
        assert per_func.tolist() == [[1.0, 1.0]] * 2
    assert len(loops) == 6 and all(loop is loops[0] for loop in loops) and not loops[0].is_closed()

    async def where(x: str) -> str:
        """Says nothing.

        Args:
            x: Anything.
        """
        loops.append(asyncio.get_running_loop())
        return "ok"

    box = Toolbox(calculator.make_tokenizer(), [where], timeout=5)
    assert box.start(where, {"x": "a"}).result() == "ok" and loops[-1] is loops[0]


def test_log_extra_and_log_metric_reach_the_step_and_the_completions(tiny_base_dir, tmp_path):
    import json

    def judged(completions, log_extra, log_metric, **kwargs):
        log_extra("verdict", ["long" if len(c) > 3 else "short" for c in completions])
        log_metric("judge/calls", 1.0)
        return [float(len(c)) for c in completions]

    trainer = make_trainer(
        tiny_base_dir, tmp_path, quantization="none", max_steps=2, reward_funcs=[judged], log_completions=True
    )
    trainer.train()
    assert [m["judge/calls"] for m in trainer.state.log_history] == [1.0, 1.0]
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert records and all(r["verdict"] == ("long" if len(r["completion"]) > 3 else "short") for r in records)


def test_log_extra_takes_numpy_values_and_nan_as_trl_does(tiny_base_dir, tmp_path):
    """numpy scalars and arrays, and NaN inside nested values: TRL's table takes them; completions.jsonl's
    json.dumps raised in the log stage and stopped the run at step 1 (found in review). summary.json is strict
    JSON too: a reward that applies to no completion (NaN) is null there, as in metrics.jsonl."""
    import json

    import numpy as np

    def judged(completions, log_extra, **kwargs):
        log_extra("length", np.array([len(c) for c in completions]))
        log_extra("scores", [{"nested": [float("nan"), np.float32(0.5)]} for _ in completions])
        return [None] * len(completions)

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        quantization="none",
        max_steps=2,
        reward_funcs=[length, judged],
        log_completions=True,
    )
    trainer.train()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    run = tmp_path / "run"
    records = [
        json.loads(line, parse_constant=refuse)
        for line in (run / "completions.jsonl").read_text().splitlines()
    ]
    assert all(r["length"] == len(r["completion"]) for r in records)
    assert records[0]["scores"] == {"nested": [None, 0.5]}
    json.loads((run / "summary.json").read_text(), parse_constant=refuse)


def test_each_completion_of_a_group_gets_its_own_copy_of_the_rows_lists():
    """A judge that builds its conversation in place (prompt.extend(completion)) saw the group's earlier
    completions in the same list: the G rows shared one object (TRL's rows are each fetched anew; found in
    review)."""
    from types import SimpleNamespace

    G, chat = 3, [{"role": "user", "content": "2+2?"}]
    rollout = SimpleNamespace(
        prompts=["u: 2+2?\na: "] * G,
        completions=["4", "5", "6"],
        completion_ids=torch.tensor([[5, 1], [6, 1], [7, 1]]),
        completion_mask=torch.ones(3, 2),
        completion_lengths=torch.tensor([2, 2, 2]),
        truncated=torch.tensor([False] * 3),
    )
    rows = {"prompt": ["u: 2+2?\na: "], "prompt_messages": [chat], "steps": [["a", "b"]]}
    prompts, completions, columns = R.rollout_keywords(rollout, rows, G, None, "prompt_messages")
    built = []

    def judge(prompts, completions, **kwargs):
        for prompt, completion in zip(prompts, completions):
            prompt.extend(completion)
            built.append(len(prompt))
        return [1.0] * len(prompts)

    R.compute_rewards([judge], prompts, completions, columns)
    assert built == [2, 2, 2] and rows["prompt_messages"] == [chat] and len(chat) == 1
    assert columns["steps"][0] == columns["steps"][1] and columns["steps"][0] is not columns["steps"][1]


def test_conversational_inputs_per_row():
    msgs = [{"role": "user", "content": "hi"}]
    prompts, completions = R.conversational_inputs(["u: hi\na: ", "2+2="], ["hello", "4"], [msgs, None])
    assert prompts == [msgs, "2+2="]
    assert completions == [[{"role": "assistant", "content": "hello"}], "4"]
    assert R.conversational_inputs(["p"], ["c"], None) == (["p"], ["c"])


def test_builtins_read_text_and_conversational_completions_alike(monkeypatch):
    monkeypatch.setattr(reward_builtins, "_math_verify", None)
    text = ["<think>x</think><answer>4</answer>", "<answer>5</answer>"]
    chat = [[{"role": "assistant", "content": t}] for t in text]
    for completions in (text, chat):
        assert think_answer_format(completions=completions) == [1.0, 0.0]
        assert answer_accuracy(completions=completions, answer=["4", "4"]) == [1.0, 0.0]


def test_split_modules_reexport_the_same_objects_and_import_downwards():
    # The package re-exports the built-ins and the resolution; the lower modules never import it
    # (no import cycle), and builtins imports nothing from the package.
    for mod in (reward_builtins, reward_specs):
        for name in mod.__all__:
            assert getattr(R, name) is getattr(mod, name), name
    for mod, allowed in (
        (reward_builtins, set()),
        (reward_specs, {"tasks.countdown", "builtins", "models", "model.loading"}),
    ):
        tree = ast.parse(inspect.getsource(mod))
        local = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
        assert local <= allowed, (mod.__name__, local)


def test_a_row_no_function_scores_logs_trls_warning_and_is_nan(caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        rewards, _, _ = compute_rewards(
            [named("f", const(1.0, None, 0.0)), named("g", const(None, None, 2.0))],
            _q(3),
            ["a", "b", "c"],
            {"task": ["x", "y", "z"], "completion_ids": [[1], [2], [3]]},
        )
    assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 2.0
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(
        "All reward functions returned None for the following kwargs:\n{'task': 'y', 'prompt': 'q', "
        "'completion': 'b'}\nPlease ensure that at least one reward function returns a valid reward."
    )


def test_the_native_trainer_trains_on_a_multi_task_dataset_with_unscored_rows(
    tiny_base_dir, tmp_path, caplog
):
    import logging

    def math_only(completions, task, **kw):
        return [float(len(c) % 2) if t == "math" else None for c, t in zip(completions, task, strict=True)]

    rows = [{"prompt": f"{i}+1=", "task": ("math", "chat")[i % 2]} for i in range(4)]
    # 2 prompts per step over 4 rows, 2 steps: one epoch, so both chat rows are drawn
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(
            tiny_base_dir, str(tmp_path), reward_funcs=[math_only], train_dataset=rows, max_steps=2
        )
        trainer.train()
    assert any(
        "All reward functions returned None for the following kwargs" in r.getMessage()
        for r in caplog.records
    )
    assert trainer.state.global_step == 2
