"""Every loss type's facts live in one registry (lora_grpo/algo/loss_types.py): its name is spelled
there, and in TRL's translation only where TRL's spelling must be named (trl/config.py: TRL's
default), nowhere else in the package, docstrings and comments included."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from lora_grpo import GRPOConfig
from lora_grpo.algo.loss import AGGREGATIONS, OBJECTIVES, LossSettings, grpo_loss
from lora_grpo.algo.loss_types import LOSS_TYPES, Aggregation, Objective

PACKAGE = Path(__file__).resolve().parent.parent / "lora_grpo"
ALLOWED = {"algo/loss_types.py", "trl/config.py"}
# grpo is also the method's name: the Hub tag of the models lora_grpo trains (model/adapters.py's TAGS), as TRL's
METHOD_NAME = {"grpo": {"model/adapters.py"}}


def spelled(text: str, name: str) -> bool:
    """Whether `name` stands in `text` as a loss type: a word of its own, not a piece of a longer
    name (dr_grpo's grpo, lora-grpo, sapo_temperature_pos, a metric's vespo/..., a file's grpo.yaml),
    and not TRL's command `trl grpo`."""
    return re.search(rf"(?<![\w\-/.])(?<!trl ){re.escape(name)}(?![\w\-/]|\.\w)", text) is not None


def modules_spelling(name: str) -> set[str]:
    return {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if spelled(path.read_text(encoding="utf-8"), name)
    }


def test_the_spelling_check_finds_what_it_should():
    assert spelled("loss_type='grpo'", "grpo") and spelled("`'luspo'` loss", "luspo")
    assert spelled("grpo | bnpo | dapo", "bnpo") and spelled("as dapo.", "dapo")
    assert not spelled("lora-grpo train", "grpo") and not spelled("dr_grpo", "grpo")
    assert not spelled("sapo_temperature_pos", "sapo") and not spelled('"vespo/phi_seq_mean"', "vespo")
    assert not spelled("`trl grpo --config`", "grpo") and not spelled("--config grpo.yaml", "grpo")


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_each_loss_type_name_is_spelled_in_the_registry_and_trls_translation_only(name):
    found = modules_spelling(name)
    assert "algo/loss_types.py" in found
    allowed = ALLOWED | METHOD_NAME.get(name, set())
    assert found <= allowed, f"{name!r} spelled outside the registry: {sorted(found - allowed)}"


def test_trls_loss_type_warnings_live_once():
    sources = [p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")]
    for start in ("When using `'luspo'` loss", "VESPO computes sequence-level", "loss sums per-token"):
        assert sum(s.count(start) for s in sources) == 1, start


def test_every_objective_and_aggregation_has_its_tensor_functions():
    assert set(OBJECTIVES) == set(Objective) and set(AGGREGATIONS) == set(Aggregation)
    assert {entry.aggregation for entry in LOSS_TYPES.values()} == set(Aggregation)
    assert {entry.objective for entry in LOSS_TYPES.values()} == set(Objective)


def test_loss_settings_are_the_configs_fields():
    config = GRPOConfig(
        model_name_or_path="toy", loss_type="cispo", epsilon_high=5.0, beta=0.1, sapo_temperature_neg=2.0
    )
    settings = LossSettings.from_config(config)
    assert (settings.loss_type, settings.epsilon_high, settings.beta, settings.sapo_temperature_neg) == (
        "cispo",
        5.0,
        0.1,
        2.0,
    )
    # grpo_loss's defaults are LossSettings' defaults, and GRPOConfig has every one of its fields
    assert {f.name for f in dataclasses.fields(LossSettings)} <= {f.name for f in dataclasses.fields(config)}


def test_grpo_loss_takes_settings_or_their_fields_by_name():
    torch.manual_seed(0)
    logp = torch.randn(3, 4, requires_grad=True)
    old, ref = logp.detach() + 0.1 * torch.randn(3, 4), logp.detach() - 0.2
    adv, mask = torch.tensor([1.0, -0.5, 0.3]), torch.ones(3, 4)
    settings = LossSettings(loss_type="grpo", beta=0.04, epsilon_high=0.28)
    by_record, _ = grpo_loss(logp, old, ref, adv, mask, settings)
    by_name, _ = grpo_loss(logp, old, ref, adv, mask, loss_type="grpo", beta=0.04, epsilon_high=0.28)
    overridden, _ = grpo_loss(logp, old, ref, adv, mask, settings, beta=0.0)
    assert by_record.item() == by_name.item()
    assert overridden.item() != by_record.item()
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        grpo_loss(logp, old, ref, adv, mask, epsilon=0.2)
