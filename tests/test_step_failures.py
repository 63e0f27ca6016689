"""Faults a run meets, end to end through train(): what a user who meets each one sees (the message,
whether the run stops, what is kept on disk), in one place.

Whatever raises inside a step keeps the last finished step (run/failures.py): a fault planted in each stage,
in step 2 (one step finished) and in step 1 (none). The message names the stage and the step; the
checkpoint of the last finished step exists, and resuming from it repeats the uninterrupted run's next
steps exactly (metrics and both adapters, bit for bit); a run that finished no step writes nothing.
Then the faults of the reward functions at run time, of the datasets and the model's settings at start, and
of a resume whose dataset changed. The pieces have their own tests (test_startup, test_data, test_rewards'
contract, test_health, test_run_dir)."""

import errno
import json
import math
import re

import datasets
import pytest
from helpers import PROMPTS, SMALL_RUN, assert_same_adapters, digit_share, make_trainer, run_torchrun

import lora_grpo.run.checkpoint as ckpt
import lora_grpo.sampler as sampler_module
from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.rewards.scoring import RewardFunctionError, compute_rewards
from lora_grpo.run.failures import StepFailed

# 3 steps of 2 prompts × 2 completions of 4 tokens, fp32; the reference moves (beta) but is never synced.
RUN = dict(
    quantization="none",
    num_generations=2,
    max_prompt_length=32,
    max_completion_length=4,
    micro_batch_size=8,
    seed=42,
    gradient_checkpointing=False,
    learning_rate=1e-2,
    max_steps=3,
    save_steps=0,
    log_completions=True,
)
TRAIN = [{"prompt": row["prompt"]} for row in PROMPTS[:12]]
EVAL = dict(
    eval_dataset=[{"prompt": row["prompt"]} for row in PROMPTS[12:15]],
    eval_steps=1,
    eval_on_start=False,
    eval_on_end=False,
)


def _comparable(history):
    """A step's record but its timings: what a resumed step must repeat exactly."""
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"}
        for r in history
    ]


def _score(fail_in_step=None, box=None):
    """digit_share, raising in step `fail_in_step` (1-based) of the trainer in `box`."""

    def score(completions, trainer_state, **kwargs):
        if fail_in_step is not None and trainer_state.global_step + 1 == fail_in_step:
            raise KeyError("score")
        return digit_share(None, completions)

    return score


def _plant(stage, trainer, step, monkeypatch):
    """A fault raised inside `stage` of step `step` (1-based); 'eval' in step 1 is the eval before training."""

    def in_step():  # before the step's update
        return trainer.state.global_step + 1 == step

    if stage == "rollout":  # after sampling: the sampling RNG has moved, the resume must not see it
        real = sampler_module.generate_rollout

        def generate(*args, **kwargs):
            out = real(*args, **kwargs)
            if in_step():
                raise ValueError("cannot apply the chat template to row 3")
            return out

        monkeypatch.setattr(sampler_module, "generate_rollout", generate)
    elif stage == "update":  # after a micro-batch's backward, before the optimizer step: an out-of-memory
        real_accumulate = trainer.update.accumulate

        def accumulate(*args, **kwargs):
            out = real_accumulate(*args, **kwargs)
            if in_step():
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return out

        monkeypatch.setattr(trainer.update, "accumulate", accumulate)
    elif stage == "eval":
        real_evaluate = trainer.evaluator.evaluate

        def evaluate(*args, **kwargs):
            if trainer.state.global_step == (0 if step == 1 else step):  # after step `step`'s update
                raise TimeoutError("the judge did not answer")
            return real_evaluate(*args, **kwargs)

        monkeypatch.setattr(trainer.evaluator, "evaluate", evaluate)
    elif stage == "log":  # a tracker or a callback's on_log, after the step's record is written

        def tracker(name, t, **payload):
            if name == "log" and t.state.global_step == step:
                raise ConnectionError("the tracker is down")

        trainer.hooks.append(tracker)
    elif stage == "checkpoint":
        real_save = ckpt.save_checkpoint

        def save(target, *args, **kwargs):
            if target.name == f"checkpoint-{step}":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(target, *args, **kwargs)

        monkeypatch.setattr(ckpt, "save_checkpoint", save)


# stage, its config, the message, the checkpoint a failure in step 2 keeps (its step end pending for the eval)
CASES = {
    "rollout": ({}, r"the rollout raised ValueError: cannot apply the chat template", 1),
    "reward": ({}, r"after 1 of 3 optimizer steps: reward function 'score' raised KeyError", 1),
    "update": (
        {},
        r"the update raised RuntimeError: CUDA out of memory\. Tried to allocate 2\.00 GiB \(out of memory: set "
        r"micro_batch_size auto \(a probe sizes it at start\) or lower it \(now 8\); turn gradient_checkpointing "
        r"on; lower prompts_per_step \(now \d+\) × num_generations \(now 2\) or max_completion_length \(now 4\)",
        1,
    ),
    "eval": (EVAL, r"the eval raised TimeoutError: the judge did not answer", 2),
    # (it kept no step at all: found in review; its record, written before the failure, is there once)
    "log": ({}, r"the log raised ConnectionError: the tracker is down", 2),
    "checkpoint": (
        {"save_steps": 1},
        r"the checkpoint raised \w+Error: .*could not write checkpoint checkpoint-2.*No "
        r"space left",
        1,
    ),
}


@pytest.fixture(scope="module")
def uninterrupted(tiny_base_dir, tmp_path_factory):
    """The runs without a fault: the plain one and the one with an eval after every step."""
    runs = {}
    for name, extra in (("plain", {}), ("eval", EVAL)):
        trainer = make_trainer(
            tiny_base_dir,
            tmp_path_factory.mktemp(name),
            **{**RUN, **extra},
            reward_funcs=[_score()],
            train_dataset=TRAIN,
        )
        trainer.train()
        runs[name] = trainer
    return runs


@pytest.mark.parametrize("stage", list(CASES))
def test_a_fault_in_step_2_keeps_step_1_and_resumes_to_the_same_run(
    tiny_base_dir, tmp_path, uninterrupted, stage, monkeypatch
):
    extra, message, kept = CASES[stage]
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **{**RUN, **extra},
        train_dataset=TRAIN,
        reward_funcs=[_score(2 if stage == "reward" else None)],
    )
    _plant(stage, trainer, 2, monkeypatch)
    error = RewardFunctionError if stage == "reward" else StepFailed
    with pytest.raises(error, match=r"^step 2/3 stopped: " + message) as info:
        trainer.train()
    run = tmp_path / "run"
    assert info.value.stage == stage and str(info.value.__cause__) in str(
        info.value
    )  # the original error, chained
    written = stage != "checkpoint"  # a failed write writes no other; the previous checkpoint is kept
    assert info.value.checkpoint == (run / f"checkpoint-{kept}" if written else None)
    assert (
        f"checkpoint written to {run}/checkpoint-{kept}"
        if written
        else f"the last checkpoint, {run}/checkpoint-1, is kept"
    ) in str(info.value) and "resume_from_checkpoint='latest'" in str(info.value)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(("checkpoint", ".checkpoint"))) == [
        f"checkpoint-{kept}"
    ]
    monkeypatch.undo()
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path,
        **{**RUN, **extra},
        train_dataset=TRAIN,
        reward_funcs=[_score()],
        resume_from_checkpoint="latest",
    )
    resumed.train()
    reference = uninterrupted["eval" if stage == "eval" else "plain"]
    assert _comparable(resumed.state.log_history) == _comparable(reference.state.log_history)
    # each record once, none lost (but a failed eval's step: its completions, logged with its record, are not)
    for log in ("metrics.jsonl", *(("completions.jsonl",) if stage != "eval" else ())):
        logged = [json.loads(line)["step"] for line in (run / log).read_text().splitlines()]
        assert logged == [json.loads(line)["step"] for line in (reference.output_dir / log).open()], log
    assert_same_adapters(resumed.model, reference.model)


def test_a_fault_in_the_eval_after_training_keeps_the_last_step_and_the_resume_ends_the_run(
    tiny_base_dir, tmp_path, monkeypatch, capsys
):
    """The eval after the last step fails: the last step is kept, and the resume runs the end it missed (the eval,
    the final adapter, summary.json), ending as the run without the fault ends."""
    settings = {**RUN, **EVAL, "eval_steps": 100, "eval_on_end": True}
    plain = make_trainer(
        tiny_base_dir, tmp_path / "plain", **settings, train_dataset=TRAIN, reward_funcs=[_score()]
    )
    plain.train()
    trainer = make_trainer(tiny_base_dir, tmp_path, **settings, train_dataset=TRAIN, reward_funcs=[_score()])
    _plant("eval", trainer, 3, monkeypatch)
    with pytest.raises(
        StepFailed, match=r"^the end of the run stopped: the eval raised TimeoutError"
    ) as info:
        trainer.train()
    run = tmp_path / "run"
    assert info.value.checkpoint == run / "checkpoint-3" and not (run / "summary.json").exists()
    monkeypatch.undo()

    def resumed():
        kw = dict(train_dataset=TRAIN, reward_funcs=[_score()], resume_from_checkpoint="latest")
        return make_trainer(tiny_base_dir, tmp_path, **settings, **kw)

    trainer = resumed()
    summary = trainer.train()
    assert json.loads((run / "summary.json").read_text())["steps"] == 3 and summary["eval_after"]
    assert _comparable(trainer.state.log_history) == _comparable(plain.state.log_history)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # resumed again, the run has ended: nothing is trained, evaluated or saved
    ended = (run / "summary.json").read_bytes()
    capsys.readouterr()
    resumed().train()
    assert "nothing left to train" in capsys.readouterr().out and (run / "summary.json").read_bytes() == ended


def test_a_final_adapter_that_could_not_be_written_is_written_by_the_resume_which_logs_the_eval_once(
    tiny_base_dir, tmp_path, monkeypatch
):
    """The eval after training is logged, then the final adapter's write fails (a full disk): the resume runs the
    end again, and its eval was in metrics.jsonl twice (found in review)."""
    settings = {**RUN, **EVAL, "eval_steps": 100, "eval_on_end": True}
    plain = make_trainer(
        tiny_base_dir, tmp_path / "plain", **settings, train_dataset=TRAIN, reward_funcs=[_score()]
    )
    plain.train()
    trainer = make_trainer(tiny_base_dir, tmp_path, **settings, train_dataset=TRAIN, reward_funcs=[_score()])

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "_save_final_adapter", full_disk)
    with pytest.raises(StepFailed, match=r"^the end of the run stopped"):
        trainer.train()
    monkeypatch.undo()
    kw = dict(train_dataset=TRAIN, reward_funcs=[_score()], resume_from_checkpoint="latest")
    make_trainer(tiny_base_dir, tmp_path, **settings, **kw).train()

    def steps(run):
        return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert steps(tmp_path / "run") == steps(plain.output_dir) == [1, 2, 3, 3]  # (3 twice: the step, the eval)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


# (a fault in step 1's log comes after its update: that step is kept, as in step 2)
@pytest.mark.parametrize("stage", [stage for stage in CASES if stage != "log"])
def test_a_fault_in_step_1_writes_nothing(tiny_base_dir, tmp_path, stage, monkeypatch):
    extra, message, _ = CASES[stage]
    extra = {**extra, "eval_on_start": True} if stage == "eval" else extra
    message = message.replace("after 1 of", "after 0 of").replace("checkpoint-2", "checkpoint-1")
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **{**RUN, **extra},
        train_dataset=TRAIN,
        reward_funcs=[_score(1 if stage == "reward" else None)],
    )
    _plant(stage, trainer, 1, monkeypatch)
    with pytest.raises(StepFailed, match=r"^step 1/3 stopped: " + message) as info:
        trainer.train()
    assert info.value.stage == stage and info.value.checkpoint is None and info.value.__cause__ is not None
    trained = stage == "checkpoint"  # step 1 trained, but its checkpoint could not be written
    assert ("no checkpoint is kept" if trained else "nothing was trained yet") in str(info.value)
    run = tmp_path / "run"
    assert not [p.name for p in run.iterdir() if "checkpoint" in p.name or p.name == "adapter"]


def test_a_failure_inside_the_optimizer_step_keeps_the_previous_checkpoint(
    tiny_base_dir, tmp_path, uninterrupted
):
    # The adapters may be half-updated: nothing is written from them; checkpoint-1 (save_steps) is what is kept.
    trainer = make_trainer(
        tiny_base_dir, tmp_path, **{**RUN, "save_steps": 1}, train_dataset=TRAIN, reward_funcs=[_score()]
    )
    real_step = trainer.optimizer.step

    def step(*args, **kwargs):
        real_step(*args, **kwargs)
        if trainer.state.global_step == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    trainer.optimizer.step = step
    with pytest.raises(
        StepFailed,
        match=r"^step 2/3 stopped: the update raised RuntimeError: CUDA error.*the last "
        r"checkpoint, .*checkpoint-1, is kept",
    ) as info:
        trainer.train()
    assert info.value.checkpoint is None
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    resumed = make_trainer(
        tiny_base_dir,
        tmp_path,
        **RUN,
        train_dataset=TRAIN,
        reward_funcs=[_score()],
        resume_from_checkpoint="latest",
    )
    resumed.train()
    assert_same_adapters(resumed.model, uninterrupted["plain"].model)


# ----------------------------------------------------------------------------- an environment's server


class Desk:
    """A tool environment whose server goes away: its constructor or reset raise in the step `fail` says."""

    fail: tuple[str, int] | None = None  # ("constructor" | "reset", the 1-based step)
    trainer = None

    @classmethod
    def _down(cls, what: str) -> None:
        if (
            cls.fail
            and cls.fail[0] == what
            and cls.trainer is not None
            and cls.trainer.state.global_step + 1 == cls.fail[1]
        ):
            raise ConnectionError("cannot reach the environment server at localhost:8000")

    def __init__(self):
        self._down("constructor")

    def reset(self, **row):
        self._down("reset")

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return key[::-1]


def _length(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def _desk_run(base, out, **fields):
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in PROMPTS[:8]]
    config = GRPOConfig(
        **{
            **RUN,
            "model_name_or_path": base,
            "output_dir": str(out),
            "max_completion_length": 12,
            "max_tool_calling_iterations": 1,
            "eval_on_start": False,
            "eval_on_end": False,
            **fields,
        }
    )
    trainer = GRPOTrainer(config, reward_funcs=[_length], train_dataset=chat, environment_factory=Desk)
    Desk.trainer = trainer
    return trainer


@pytest.mark.parametrize("what, step", [("reset", 2), ("reset", 1), ("constructor", 1)])
def test_an_environment_that_goes_away_keeps_the_last_finished_step(
    qwen_tool_base_dir, tmp_path, monkeypatch, what, step
):
    # The pool's instances are built in the first rollout: a constructor fails there, or in an eval's larger batch.
    monkeypatch.setattr(Desk, "trainer", None)
    monkeypatch.setattr(Desk, "fail", (what, step))
    trainer = _desk_run(qwen_tool_base_dir, tmp_path / "run")
    with pytest.raises(
        StepFailed,
        match=rf"^step {step}/3 stopped: the environment \(in the rollout\) raised "
        r"ConnectionError: cannot reach the environment server",
    ) as info:
        trainer.train()
    assert info.value.stage == "environment" and isinstance(info.value.__cause__, ConnectionError)
    kept = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert kept == (["checkpoint-1"] if step == 2 else [])
    if step == 1:
        return
    monkeypatch.setattr(Desk, "fail", None)
    resumed = _desk_run(qwen_tool_base_dir, tmp_path / "run", resume_from_checkpoint="latest")
    resumed.train()
    reference = _desk_run(qwen_tool_base_dir, tmp_path / "reference")
    reference.train()
    assert _comparable(resumed.state.log_history) == _comparable(reference.state.log_history)
    assert_same_adapters(resumed.model, reference.model)


# ----------------------------------------------------------------------------- two processes

TWO_PROCESSES = """
import json, sys, torch
from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.run.failures import StepFailed
import lora_grpo.sampler as sampler_module

from helpers import digit_share

base, out = sys.argv[1], sys.argv[2]
prompts = [{"prompt": f"{i}+{i % 5}="} for i in range(16)]
real = sampler_module.generate_rollout

def run(output_dir, fail=False, **kw):
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                     max_completion_length=5, micro_batch_size=4, max_steps=3, beta=0.04, learning_rate=1e-2,
                     output_dir=output_dir, gradient_checkpointing=False, **kw)
    t = GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=prompts)
    def generate(*args, **kwargs):  # both processes lose the server in step 2
        rollout = real(*args, **kwargs)
        if fail and t.state.global_step == 1:
            raise ConnectionError("the sampling server went away")
        return rollout
    sampler_module.generate_rollout = generate
    t.train()
    return t

rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
try:
    run(out + "/failed", fail=True, save_steps=1)
    message = None
except StepFailed as e:
    message = [str(e), e.stage, e.global_step, str(e.checkpoint)]
full = run(out + "/full")
resumed = run(out + "/failed", resume_from_checkpoint="latest")
pairs = zip(full.model.named_parameters(), resumed.model.named_parameters())
same = all(torch.equal(p, q) for (_, p), (_, q) in pairs)
rank = full.accelerator.process_index
loss = [[m["loss"] for m in t.state.log_history] for t in (full, resumed)]
json.dump({"message": message, "same": same, "loss": loss}, open(f"{out}/failed{rank}.json", "w"))
"""


def test_two_processes_that_fail_alike_keep_the_last_finished_step(tiny_base_dir, tmp_path):
    """Both processes' rollouts raise: they agree on it (run.failures.agreed_failures) and write the last finished
    step together, which resumes exactly."""
    import json

    run_torchrun(TWO_PROCESSES, tmp_path, tiny_base_dir, tmp_path, timeout=240)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"failed{rank}.json").read_text())
        text, stage, step, checkpoint = record["message"]
        assert stage == "rollout" and step == 1 and checkpoint == str(tmp_path / "failed" / "checkpoint-1")
        assert text.startswith(
            "step 2/3 stopped: the rollout raised ConnectionError: the sampling server went away"
        )
        assert f"checkpoint written to {tmp_path / 'failed' / 'checkpoint-1'}" in text
        assert record["same"], f"process {rank}: resumed adapters differ from the uninterrupted run"
        assert record["loss"][0] == record["loss"][1]


# ----------------------------------------------------------------------------- the resume hint of each entry point


def test_the_cli_says_the_command_that_resumes_and_the_trl_front_door_its_own_call(
    tiny_base_dir, tmp_path, monkeypatch, capsys
):
    import shlex

    from helpers import write_recipe

    from lora_grpo.cli import main
    from lora_grpo.trl import GRPOConfig as TRLConfig
    from lora_grpo.trl import GRPOTrainer as TRLTrainer

    real = sampler_module.generate_rollout
    steps = []

    def generate(*args, **kwargs):  # the second training rollout fails (the evals sample too: counted apart)
        steps.append(kwargs.get("num_generations"))
        if steps.count(2) == 2 and kwargs.get("num_generations") == 2:
            raise ConnectionError("gone")
        return real(*args, **kwargs)

    recipe = write_recipe(
        tmp_path, tiny_base_dir, max_steps=3, save_steps=1, eval_on_start=False, eval_on_end=False
    )
    monkeypatch.setattr(sampler_module, "generate_rollout", generate)
    assert main(["train", str(recipe), "--set", "max_steps=3", "--set", "beta=0.1"]) == 1
    err = capsys.readouterr().err
    command = f"lora-grpo train {recipe} --set max_steps=3 --set beta=0.1 --set resume_from_checkpoint=latest"
    assert (
        "step 2/3 stopped: the rollout raised ConnectionError: gone" in err
        and command in err
        and "<recipe>" not in err
    )
    monkeypatch.setattr(sampler_module, "generate_rollout", real)
    assert main(shlex.split(command)[1:]) == 0  # the printed command, as it is, resumes the run

    steps.clear()
    monkeypatch.setattr(sampler_module, "generate_rollout", generate)
    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=3,
        save_steps=1,
        logging_steps=1,
        report_to=[],
    )
    trainer = TRLTrainer(model=tiny_base_dir, reward_funcs=digit_share, args=args, train_dataset=TRAIN)
    with pytest.raises(ConnectionError, match="gone") as raised:  # as TRL: the step's own error, with a note
        trainer.train()
    assert raised.value.__notes__[-1].endswith("then resume: trainer.train(resume_from_checkpoint=True)")


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
    said = (
        "reward function 'remote_reward' raised TimeoutError: the scoring service did not answer on the batch of 4 "
        "completions (not called again per sample: reward_bisect_on_error=false)"
    )
    if front_door == "native":
        with pytest.raises(RewardFunctionError, match=re.escape(said)) as info:
            trainer.train()
        assert info.value.function == "remote_reward"
    else:  # as TRL: the function's own error, lora_grpo's words as its note
        with pytest.raises(TimeoutError, match="the scoring service did not answer") as info:
            trainer.train()
        assert said in info.value.__notes__[-1]
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
        (PROMPTS[:1], None, r"the train dataset has 1 rows, fewer than one batch of prompts_per_step=2"),
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
