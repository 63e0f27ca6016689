import json
from pathlib import Path

import pytest
import torch
from helpers import write_recipe

from lora_grpo.cli import load_config, main, shipped_recipes
from lora_grpo.config import ConfigError, GRPOConfig


@pytest.fixture
def recipe(tiny_base_dir, tmp_path):
    return write_recipe(
        tmp_path,
        tiny_base_dir,
        reward_funcs=["accuracy", {"name": "length", "kwargs": {"target_length": 2}}],
        max_steps=2,
        save_steps=0,
        learning_rate=1e-3,
    )


def test_train_from_recipe_with_overrides(recipe, tmp_path, capsys):
    assert main(["train", str(recipe), "--set", "max_steps=3", "--set", "beta=0.1"]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert "accuracy_before" in summary and "accuracy_after" in summary
    saved = (run / "config.yaml").read_text()
    assert "max_steps: 3" in saved and "beta: 0.1" in saved
    out = capsys.readouterr().out
    assert "step 3/3" in out and "eval after training" in out


def test_config_errors_exit_2_with_the_field_named(recipe, capsys):
    assert main(["train", str(recipe), "--set", "lora_rank=8"]) == 2
    assert "did you mean 'lora_r'" in capsys.readouterr().err
    assert main(["train", str(recipe), "--set", "num_generations=1"]) == 2
    assert "num_generations=1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        ("lora_r: 4.5", "lora_r=4.5 must be an integer, e.g. 16 (its default)"),
        ("lora_r: [4]", "lora_r=[4] must be an integer, e.g. 16 (its default)"),
        ("max_steps: 1.5", "max_steps=1.5 must be an integer, e.g. 100 (its default)"),
        (
            "reward_weights: [.nan]",
            "reward_weights=[nan] must be a list of finite numbers or null (reward_weights[0]",
        ),
        (
            "reward_weights: [1, .inf]",
            "reward_weights=[1, inf] must be a list of finite numbers or null (reward_weights[1]",
        ),
        (
            "reward_weights: [a]",
            "reward_weights=['a'] must be a list of finite numbers or null (reward_weights[0] is 'a')",
        ),
    ],
)
def test_a_recipe_value_of_the_wrong_type_is_refused_at_its_line_as_set_refuses_it(
    tmp_path, capsys, line, message
):
    # was: lora_r crashed inside torch, max_steps=1.5 trained 2 steps, a NaN weight dropped its reward
    path = tmp_path / "r.yaml"
    path.write_text(f"model_name_or_path: toy\nreward_funcs: [format]\n{line}\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"lora-grpo: config error: {path}, line 3: {message}" in err and "Traceback" not in err
    assert main(["train", str(path), "--set", line.replace(": ", "=", 1)]) == 2
    assert f"lora-grpo: config error: {message}" in capsys.readouterr().err


def test_options_that_contradict_each_other_exit_2_before_training(recipe, tmp_path, capsys):
    # was: 3 prompts a step silently became 4
    sets = ["--set", "generation_batch_size=8", "--set", "prompts_per_step=3", "--set", "num_generations=2"]
    assert main(["train", str(recipe), *sets]) == 2
    assert (
        "'generation_batch_size' and 'prompts_per_step' can not be both configured" in capsys.readouterr().err
    )
    # was: trained with neither an eval nor a warning
    assert main(["train", str(recipe), "--set", "eval_steps=5", "--set", "eval_dataset=none"]) == 2
    err = capsys.readouterr().err
    assert "eval_steps=5 asks for evals during training, but there are no eval prompts" in err
    assert err.rstrip().endswith("or eval_steps=0") and not (tmp_path / "run").exists()


def test_prompt_template_errors_are_messages_naming_it(recipe, capsys):
    assert main(["train", str(recipe), "--set", "prompt_template=Q: {question"]) == 2
    err = capsys.readouterr().err
    assert "config error: prompt_template='Q: {question' is not a format string" in err
    # was: a KeyError traceback
    assert main(["train", str(recipe), "--set", "prompt_template=Q: {questoin}"]) == 1
    err = capsys.readouterr().err
    assert (
        "lora-grpo: error: train_dataset: prompt_template='Q: {questoin}' uses the field {questoin}, which is not "
        "a column" in err
    )
    assert "did you mean {question}?" in err and "Traceback" not in err


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for field in ["ref_sync_alpha", "ref_sync_mode", "micro_batch_size", "loss_type"]:
        assert field in out


def test_plot_and_merge(recipe, tmp_path, tiny_base_dir):
    pytest.importorskip("matplotlib")
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    assert main(["plot", str(run)]) == 0
    assert (run / "metrics.png").stat().st_size > 1000
    # --out: a file of the user's is never written over without --overwrite; a name without an image suffix is
    # refused in words (matplotlib: "Format 'tmp' is not supported")
    mine = tmp_path / "mine.png"
    mine.write_text("my precious")
    assert main(["plot", str(run), "--out", str(mine)]) == 2 and mine.read_text() == "my precious"
    assert (
        main(["plot", str(run), "--out", str(tmp_path / "noext")]) == 2 and not (tmp_path / "noext").exists()
    )
    assert main(["plot", str(run), "--out", str(mine), "--overwrite"]) == 0 and mine.stat().st_size > 1000
    assert main(["plot", str(run), "--out", str(tmp_path / "m.svg")]) == 0

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["merge", str(run / "adapter"), "--recipe", str(recipe), "--out", str(out)]) == 0
    x = torch.tensor([[5, 6, 7, 8]])
    merged = AutoModelForCausalLM.from_pretrained(out)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(run / "adapter")
    )
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, peft(input_ids=x).logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ recipes: files or shipped names


def test_a_recipe_is_a_file_or_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the clone: no recipes/ directory here
    shipped = GRPOConfig.from_yaml(shipped_recipes()["toy-addition"])
    assert load_config("toy-addition", []) == shipped
    assert load_config("toy-addition.yaml", ["max_steps=3"]).max_steps == 3
    (tmp_path / "toy-addition.yaml").write_text("model_name_or_path: mine\n")  # a file of that name wins
    assert load_config("toy-addition.yaml", []).model_name_or_path == "mine"
    with pytest.raises(ConfigError, match="did you mean the shipped recipe 'toy-addition'"):
        load_config("recipes/toy-addition.yaml", [])
    with pytest.raises(ConfigError, match="shipped recipes: .*smollm2-360m-countdown-qlora"):
        load_config("no-such-recipe", [])


def test_unknown_recipe_exits_2_naming_the_shipped_ones(capsys):
    assert main(["train", "toy-additon"]) == 2
    err = capsys.readouterr().err
    assert "did you mean the shipped recipe 'toy-addition'" in err and "lora-grpo recipes" in err


def test_train_without_a_recipe_runs_the_shipped_toy_recipe(tiny_base_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    sets = [f"model_name_or_path={tiny_base_dir}", "max_steps=1", "eval_limit=4", f"output_dir={run}"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    assert "(recipe toy-addition)" in capsys.readouterr().out
    saved = (run / "config.yaml").read_text()
    assert "dataset: toy" in saved and "lora_grpo.tasks.toy:toy_reward" in saved
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_recipes_lists_each_shipped_recipe_with_its_first_comment_line(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shipped = shipped_recipes()
    assert [line.split()[0] for line in lines] == list(shipped)
    for line, (name, resource) in zip(lines, shipped.items()):
        first_comment = resource.read_text().splitlines()[0].lstrip("# ")
        assert line.split(None, 1)[1] == first_comment, name


def test_recipes_name_prints_the_recipe_to_copy(capsys):
    assert main(["recipes", "smollm2-360m-countdown-qlora"]) == 0
    text = capsys.readouterr().out
    assert text == shipped_recipes()["smollm2-360m-countdown-qlora"].read_text()
    assert main(["recipes", "nope"]) == 2


# ------------------------------------------------------------------ eval and merge of what a run leaves


def test_eval_and_merge_take_a_checkpoint_or_a_run_dir_and_a_4bit_merge_matches_the_policy(
    tiny_base_dir, tmp_path, capsys
):
    import re

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_grpo.config import GRPOConfig as Config
    from lora_grpo.export import largest_logit_difference
    from lora_grpo.model.load import load_base_model, load_tokenizer

    recipe = write_recipe(
        tmp_path,
        tiny_base_dir,
        quantization="4bit",
        max_steps=2,
        save_steps=1,
        learning_rate=5e-2,
        eval_on_start=False,
        eval_on_end=False,
    )
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["eval", str(run / "checkpoint-1"), "--recipe", str(recipe)]) == 0
    assert (
        f"lora-grpo: evaluated the policy adapter of checkpoint {run / 'checkpoint-1'}"
        in capsys.readouterr().err
    )
    assert main(["eval", str(run), "--recipe", str(recipe)]) == 0
    assert f"lora-grpo: evaluated the final adapter of the run {run}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), "--recipe", str(recipe)]) == 1
    assert "holds no adapter" in capsys.readouterr().err

    gaps = {}
    for base in ("trained", "full"):
        assert (
            main(["merge", str(run), "--recipe", str(recipe), "--out", str(tmp_path / base), "--base", base])
            == 0
        )
        line = capsys.readouterr().out
        assert (
            "the dequantised 4bit base it was trained on" if base == "trained" else "the original weights"
        ) in line
        gaps[base] = float(
            re.search(r"differ from the trained policy's by at most (\S+) on 3 prompts", line).group(1)
        )
    # Checked independently: the policy as trained (4-bit base + adapter) against each saved merged model.
    config = Config(model_name_or_path=tiny_base_dir, quantization="4bit")
    policy = PeftModel.from_pretrained(load_base_model(config), str(run / "adapter")).eval()
    tokenizer = load_tokenizer(config)
    prompts = ["12+7=", "Question: what is 3 + 4? Answer:", "The capital of France is"]
    measured = {
        base: largest_logit_difference(
            policy, AutoModelForCausalLM.from_pretrained(tmp_path / base).eval(), tokenizer, prompts
        )
        for base in gaps
    }
    assert measured["trained"] < 1e-4 < measured["full"]  # what you trained is what you get, by default
    assert gaps["trained"] == pytest.approx(measured["trained"], abs=1e-5)
    assert gaps["full"] == pytest.approx(measured["full"], rel=1e-2)
    # the merged config.json is the base's, not the training load's (use_cache off, dropout 0), but for its dtype
    base_config = json.loads((Path(tiny_base_dir) / "config.json").read_text())
    for base in gaps:
        merged = json.loads((tmp_path / base / "config.json").read_text())
        assert {
            k: v for k, v in merged.items() if base_config.get(k) != v and k not in ("dtype", "torch_dtype")
        } == {}


# ------------------------------------------------------------------ eval and merge of broken or foreign adapters


@pytest.fixture(scope="module")
def checkpointed_run(tiny_base_dir, tmp_path_factory):
    """(recipe, run dir) of a finished 3-step run on the tiny base with checkpoint-1..3; tests that damage it
    copy it first (copied_run)."""
    tmp = tmp_path_factory.mktemp("checkpointed")
    recipe = write_recipe(
        tmp,
        tiny_base_dir,
        max_steps=3,
        save_steps=1,
        save_total_limit=0,
        eval_on_start=False,
        eval_on_end=False,
    )
    assert main(["train", str(recipe)]) == 0
    return recipe, tmp / "run"


@pytest.fixture
def copied_run(checkpointed_run, tmp_path):
    import shutil

    recipe, run = checkpointed_run
    shutil.copytree(run, tmp_path / "run")
    return recipe, tmp_path / "run"


def test_eval_and_merge_of_a_run_read_its_config_without_a_recipe(checkpointed_run, tmp_path, capsys):
    """The run's own config.yaml stands in for --recipe (beside its adapter/, in a checkpoint, above a policy/):
    the same metrics as with the recipe, nothing written to the run; outside a run, one error saying what to pass."""
    recipe, run = checkpointed_run
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))

    def evaluated(*argv):
        capsys.readouterr()
        assert main(["eval", *argv]) == 0
        out = capsys.readouterr()
        return json.loads(out.out), out.err

    with_recipe, _ = evaluated(str(run), "--recipe", str(recipe))
    for adapter in (run, run / "adapter", run / "checkpoint-3", run / "checkpoint-3" / "policy"):
        metrics, err = evaluated(str(adapter))
        assert metrics == with_recipe, adapter
    assert "lora-grpo: evaluated the adapter" in err  # (policy/ is an adapter dir)
    # --set on top of the run's config
    assert evaluated(str(run), "--set", "max_completion_length=1")[0]["eval/completion_length"] == 1.0
    assert main(["merge", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before

    import shutil

    shutil.copytree(run / "adapter", tmp_path / "loose")  # an adapter outside any run
    for command in (["eval", str(tmp_path / "loose")], ["merge", str(tmp_path / "loose"), "--out", "x"]):
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert (
            f"{command[0]} needs the config the adapter was trained with: {tmp_path / 'loose'} is no run's "
            in err
        )
        assert "Pass --recipe" in err


def test_the_tokenizer_saved_with_a_runs_adapters_reloads_padded_on_the_left(checkpointed_run):
    """Batched generation with a saved adapter and its tokenizer pads prompts on the left, as a decoder generates."""
    from transformers import AutoTokenizer

    _, run = checkpointed_run
    for folder in (run / "adapter", run / "checkpoint-3"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert (tokenizer.padding_side, tokenizer.truncation_side) == ("left", "left"), folder


def test_eval_of_an_unfinished_run_names_its_newest_complete_checkpoint(copied_run, capsys):
    import shutil

    recipe, run = copied_run
    shutil.rmtree(run / "adapter")  # a run killed after checkpoint-3 began to be written
    (run / "summary.json").unlink()
    (run / "checkpoint-3" / "policy" / "adapter_model.safetensors").unlink()
    capsys.readouterr()
    assert main(["eval", str(run), "--recipe", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert f"e.g. {run / 'checkpoint-2'}, the newest complete one" in err  # was: checkpoint-3, the broken one
    assert "Incomplete, not usable: checkpoint-3 lacks policy/adapter_model.safetensors" in err
    assert main(["eval", str(run / "checkpoint-2"), "--recipe", str(recipe)]) == 0  # and that one evaluates
    for step in (1, 2):
        (run / f"checkpoint-{step}" / "trainer_state.pt").unlink()
    assert main(["eval", str(run), "--recipe", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "none of its checkpoints is complete (checkpoint-1 lacks trainer_state.pt; " in err
    assert "checkpoint-3 lacks policy/adapter_model.safetensors)" in err


def test_eval_computes_an_adapter_at_its_own_scaling_whatever_the_recipe_says(checkpointed_run, capsys):
    """An adapter evaluated under another recipe (another lora_alpha): its tensors act at the scaling of its own
    adapter_config.json, as in training and as merge and peft load it, and the line says so."""
    recipe, run = checkpointed_run
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())

    def evaluated(*argv):
        capsys.readouterr()
        assert main(["eval", str(run / "adapter"), "--recipe", str(recipe), *argv]) == 0
        out = capsys.readouterr()
        return json.loads(out.out), out.err

    own, _ = evaluated()
    other, err = evaluated("--set", f"lora_alpha={4 * saved['lora_alpha']}")
    assert (
        other == own and f"lora_alpha {saved['lora_alpha']} (the config's {4 * saved['lora_alpha']})" in err
    )


def test_eval_and_merge_take_the_tokenizer_the_run_trained_with(copied_run, tmp_path, capsys, monkeypatch):
    """A script's own tokenizer (its chat template, tokens it added) is saved beside the adapter and in each
    checkpoint, and config.yaml cannot name it: merge wrote the base's, and eval sampled with it (found in
    review)."""
    from transformers import AutoTokenizer

    from lora_grpo.trainer import GRPOTrainer

    _, run = copied_run
    for where in (run / "adapter", run / "checkpoint-3"):
        tokenizer = AutoTokenizer.from_pretrained(where)
        tokenizer.chat_template = "{{ 'MINE ' + messages[0]['content'] }}"
        tokenizer.save_pretrained(where)
    for source, out in ((run, "merged"), (run / "checkpoint-3", "merged-3")):
        assert main(["merge", str(source), "--out", str(tmp_path / out)]) == 0
        assert AutoTokenizer.from_pretrained(tmp_path / out).chat_template.startswith("{{ 'MINE")
    seen = []
    monkeypatch.setattr(GRPOTrainer, "evaluate", lambda self: seen.append(self.tokenizer.chat_template) or {})
    for source in (run, run / "checkpoint-3" / "policy"):
        assert main(["eval", str(source)]) == 0
    assert len(seen) == 2 and all(t.startswith("{{ 'MINE") for t in seen)


def test_merge_and_eval_of_a_checkpoint_without_its_weights_say_the_file_is_missing(copied_run, capsys):
    recipe, run = copied_run
    weights = run / "checkpoint-3" / "policy" / "adapter_model.safetensors"
    weights.unlink()
    capsys.readouterr()
    for command in (["merge", "--out", str(run.parent / "merged")], ["eval"]):
        assert main([command[0], str(run / "checkpoint-3"), "--recipe", str(recipe), *command[1:]]) == 1
        err = capsys.readouterr().err
        assert f"{weights} is missing: the adapter's weights were never written" in err, command[0]
        assert f"pass another checkpoint ({run / 'checkpoint-2'}, the newest complete one)" in err
        assert "Repo id" not in err  # was merge's: peft took the directory for a hub id
    assert not (run.parent / "merged").exists()


def test_a_local_adapter_dir_without_weights_is_never_read_as_a_hub_id(tmp_path):
    # The loaders' safety net (loading.explain), for any peft load of a local directory that lacks its file.
    from peft import PeftModel

    from lora_grpo.model.loading import LoadError, loading
    from lora_grpo.tasks.toy import make_tiny_model, make_tokenizer

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"})
    )
    with pytest.raises(LoadError) as caught:
        with loading("merge", "adapter", tmp_path / "adapter"):
            PeftModel.from_pretrained(make_tiny_model(make_tokenizer()), str(tmp_path / "adapter"))
    message = str(caught.value)
    assert f"{tmp_path / 'adapter'} exists locally, but the file the loader reads is not in it" in message
    assert "the directory holds ['adapter_config.json']: no adapter_model.safetensors" in message


@pytest.fixture(scope="module")
def other_bases(tmp_path_factory):
    """Two tiny bases besides tiny_base_dir: one of other sizes (hidden 32, not 64), one of the same sizes (other
    random weights)."""
    from lora_grpo.tasks.toy import save_tiny_base

    root = tmp_path_factory.mktemp("other_bases")
    return {
        "narrower": save_tiny_base(root / "narrower", hidden_size=32, max_positions=1024),
        "same-shapes": save_tiny_base(root / "same-shapes", seed=1, max_positions=1024),
    }


def test_eval_and_merge_refuse_an_adapter_of_a_base_of_other_sizes_naming_both_bases(
    checkpointed_run, other_bases, tiny_base_dir, tmp_path, capsys
):
    recipe, run = checkpointed_run
    other = other_bases["narrower"]
    capsys.readouterr()
    for command in (["eval"], ["merge", "--out", str(tmp_path / "merged")]):
        args = [command[0], str(run / "checkpoint-2"), "--recipe", str(recipe), *command[1:]]
        assert main([*args, "--set", f"model_name_or_path={other}"]) == 1
        err = capsys.readouterr().err
        assert (
            f"The policy adapter of checkpoint {run / 'checkpoint-2'} was saved for another model: its lora_"
            in err
        )
        assert f"(it was trained on the base {tiny_base_dir!r}; the base given is {other!r})" in err
        assert f"on that base: --set model_name_or_path={tiny_base_dir}" in err or (
            f"into that base: --set model_name_or_path={tiny_base_dir}" in err
        )
        # was: eval blamed lora_r (both are 4); merge printed torch's size mismatch, one line per tensor
        assert "lora_r" not in err and "size mismatch" not in err, command[0]
    assert not (tmp_path / "merged").exists()


def test_eval_and_merge_on_a_base_of_the_same_sizes_warn_with_both_names(
    checkpointed_run, other_bases, tiny_base_dir, tmp_path, caplog
):
    recipe, run = checkpointed_run
    other = other_bases["same-shapes"]
    for command in (["eval"], ["merge", "--out", str(tmp_path / "merged")]):
        caplog.clear()
        args = [command[0], str(run / "checkpoint-2"), "--recipe", str(recipe), *command[1:]]
        assert (
            main([*args, "--set", f"model_name_or_path={other}"]) == 0
        )  # it loads: a warning, not a refusal
        warned = [r.getMessage() for r in caplog.records if "was trained on the base" in r.getMessage()]
        assert warned == [
            f"The policy adapter of checkpoint {run / 'checkpoint-2'} was trained on the base {tiny_base_dir!r}, but "
            f"the base given is {other!r}. Their layers have the same shapes, so it loads, but on another base it "
            f"computes something else: use the base it was trained on, unless {other!r} is that model under another "
            "name or path"
        ], command[0]
        caplog.clear()
        assert main(args) == 0  # on its own base: no warning
        assert not [r for r in caplog.records if "was trained on the base" in r.getMessage()], command[0]


@pytest.mark.parametrize("which", ["narrower", "same-shapes"])
def test_resuming_a_run_on_another_base_is_refused_naming_both(
    copied_run, other_bases, tiny_base_dir, which, capsys
):
    recipe, run = copied_run
    other = other_bases[which]
    sets = [
        f"output_dir={run}",
        f"model_name_or_path={other}",
        "resume_from_checkpoint=latest",
        "max_steps=4",
    ]
    capsys.readouterr()
    assert main(["train", str(recipe), *[a for s in sets for a in ("--set", s)]]) == 1
    err = capsys.readouterr().err
    assert (
        f"{run / 'checkpoint-3'} was saved under a different config (model_name_or_path: checkpoint " in err
    )
    assert f"{tiny_base_dir!r}, this run {other!r})" in err


# ------------------------------------------------------------------ never over the user's files or the base


def _files(path):
    """{name: bytes} of a directory's files, to tell that nothing in it changed."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_merge_into_a_directory_of_the_users_files_is_refused_unless_overwrite(copied_run, tmp_path, capsys):
    recipe, run = copied_run
    out = tmp_path / "my_model"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (out / name).write_bytes(b"the user's shard")
    (out / "config.json").write_text('{"mine": true}')
    before = _files(out)
    merge = ["merge", str(run / "adapter"), "--recipe", str(recipe), "--out", str(out)]
    capsys.readouterr()
    # was: exit 0, both shards deleted and config.json overwritten
    assert main(merge) == 1
    err = capsys.readouterr().err
    assert (
        f"--out '{out}' holds files lora_grpo did not write there: config.json, model-00001-of-00002" in err
    )
    assert "Give --out a new directory, or add --overwrite" in err and "Traceback" not in err
    assert (
        _files(out) == before and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )

    # --overwrite replaces the directory whole: the merged model alone, loadable
    assert main([*merge, "--overwrite"]) == 0
    assert "--overwrite: replaced" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    assert not (out / "model-00001-of-00002.safetensors").exists() and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)
    # an earlier merge's output is ours: merged again without a flag, the same files
    written = sorted(p.name for p in out.iterdir())
    assert main(merge) == 0 and sorted(p.name for p in out.iterdir()) == written
    assert "replaced the earlier output" in capsys.readouterr().out
    # a file the user adds to it makes it theirs again
    (out / "NOTES.md").write_text("mine")
    assert (
        main(merge) == 1 and "holds files lora_grpo did not write there: NOTES.md" in capsys.readouterr().err
    )


def test_merge_never_writes_over_the_base_or_the_adapter_whatever_the_flags(
    copied_run, tiny_base_dir, tmp_path, capsys
):
    import shutil

    recipe, run = copied_run
    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    before = _files(base)
    merge = ["merge", str(run / "adapter"), "--recipe", str(recipe), "--set", f"model_name_or_path={base}"]
    capsys.readouterr()
    for out, why in (
        (base, f"is the base model (model_name_or_path '{base}')"),
        (base / "merged", "lies inside the base model"),
        (tmp_path, "holds the base model"),
        (run, "holds the adapter being merged"),
        (run / "adapter", "is the adapter being merged"),
    ):
        for flags in ([], ["--overwrite"]):
            assert main([*merge, "--out", str(out), *flags]) == 1, (out, flags)
            err = capsys.readouterr().err
            assert f"--out '{out}' {why}" in err and "no flag allows writing there" in err, err
    assert _files(base) == before and not (base / "merged").exists()
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    # the base named through another spelling of its path is still the base
    assert main([*merge, "--out", str(tmp_path / "x" / ".." / "base")]) == 1
    assert "is the base model" in capsys.readouterr().err and _files(base) == before


def test_train_into_a_directory_of_the_users_files_is_refused_unless_overwrite(recipe, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    (mine / "metrics.png").write_bytes(b"my plot")
    (mine / "data.csv").write_text("a,b\n")
    before = _files(mine)
    train = ["train", str(recipe), "--set", f"output_dir={mine}", "--set", "max_steps=1"]
    capsys.readouterr()
    # was: exit 0, config.yaml and metrics.png overwritten without a word
    assert main(train) == 1
    err = capsys.readouterr().err
    assert (
        f"output_dir '{mine}' holds files that are not a lora_grpo run's: config.yaml, data.csv, metrics.png"
        in err
    )
    assert "would overwrite config.yaml, metrics.png" in err and "overwrite_output_dir=true" in err
    assert "Traceback" not in err and _files(mine) == before
    assert main([*train, "--set", "overwrite_output_dir=true"]) == 0
    assert "those with a run's names moved to" in capsys.readouterr().out
    aside = mine / "previous-run-1"
    assert (aside / "config.yaml").read_text() == "my: settings\n" and (
        aside / "metrics.png"
    ).read_bytes() == b"my plot"
    assert (mine / "data.csv").read_text() == "a,b\n" and (mine / "summary.json").is_file()
    # the directory is now a run of ours: it resumes as before
    assert main([*train, "--set", "max_steps=2", "--set", "resume_from_checkpoint=latest"]) == 0


def test_train_never_writes_into_the_base(recipe, tiny_base_dir, tmp_path, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_base_dir, base)
    before = _files(base)
    for out in (base, base / "runs" / "a"):
        assert (
            main(
                [
                    "train",
                    str(recipe),
                    "--set",
                    f"model_name_or_path={base}",
                    "--set",
                    f"output_dir={out}",
                    "--set",
                    "overwrite_output_dir=true",
                ]
            )
            == 1
        )
        err = capsys.readouterr().err
        assert f"output_dir '{out}' {'is' if out == base else 'lies inside'} the base model" in err
    assert _files(base) == before and not (base / "runs").exists()


def test_merge_reads_the_base_at_the_revision_the_run_trained_on(tmp_path):
    """revision: a hub branch, tag or commit of the base. merge loads its weights (and tokenizer) at that revision,
    not the default branch's; the model card's code loads it there too. (An offline hub cache holding two
    revisions of one repository, in a process of its own: the cache's place is read at import.)"""
    import os
    import subprocess
    import sys

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_grpo.run.model_card import model_card
    from lora_grpo.tasks.toy import save_tiny_base

    repo = tmp_path / "hub" / "models--me--tiny"
    for ref, sha, seed in (("main", "a" * 40, 0), ("v1", "b" * 40, 1)):  # other weights at each revision
        save_tiny_base(repo / "snapshots" / sha, seed=seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    v1 = AutoModelForCausalLM.from_pretrained(repo / "snapshots" / ("b" * 40), dtype=torch.float32).eval()
    adapted = get_peft_model(v1, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    argv = ["merge", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]
    for field in ("model_name_or_path=me/tiny", "revision=v1", "torch_dtype=float32"):
        argv += ["--set", field]
    done = subprocess.run(
        [sys.executable, "-m", "lora_grpo.cli", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        assert (merged(ids).logits - adapted.eval()(ids).logits).abs().max() < 1e-4
    card = model_card(
        GRPOConfig.from_dict({"model_name_or_path": "me/tiny", "revision": "v1"}),
        steps=1,
        reward_names=["r"],
        syncs=0,
        where="me/tiny-grpo",
    )
    assert 'base = AutoModelForCausalLM.from_pretrained("me/tiny", revision="v1")' in card


def test_ctrl_c_outside_a_training_step_ends_in_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt while a command loads or plans (no step to save): exit 130 and one line, no traceback
    (LORA_GRPO_TRACEBACK=1 gives it)."""
    import lora_grpo.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    monkeypatch.delenv("LORA_GRPO_TRACEBACK", raising=False)
    assert main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "lora-grpo: interrupted (Ctrl-C)"
    monkeypatch.setenv("LORA_GRPO_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main(["train"])
