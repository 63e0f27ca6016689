"""A reward model as a reward function, scored exactly as TRL 1.16's GRPOTrainer scores one.

TRL accepts a sequence-classification model (or its hub id / path) among ``reward_funcs``, with its
own tokenizer in ``reward_processing_classes``. ``RewardModel`` wraps the same thing in our reward
contract (``fn(prompts=..., completions=..., **columns) -> list[float]``), so any trainer, and
evaluation, can call it like every other reward function:

- text rows are scored on ``prompt + completion``; conversational rows (message lists) on the
  reward tokenizer's chat template over prompt messages + completion messages, without a
  generation prompt (TRL's ``apply_chat_template({"messages": ...})``);
- tokenized with ``padding=True, padding_side="right", add_special_tokens=False`` (the template or
  the text already carries whatever special tokens the data has);
- the reward is ``logits[:, 0]``, read by the model at the last non-pad token, so the model's
  config gets the tokenizer's pad token id (set to eos when the tokenizer has none, as TRL does).

Where we differ, on purpose: TRL scores the whole batch in one forward under inference_mode; here
in chunks of ``batch_size`` under no_grad (the same numbers, bounded memory), and the text or
conversational form is read per row rather than from the first prompt (the same on uniform batches).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..model.loading import loading


def _texts(tokenizer, prompts: Sequence, completions: Sequence, chat_template_kwargs: dict) -> list[str]:
    texts = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(prompt, list):  # conversational: the whole conversation through the chat template
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            texts.append(
                tokenizer.apply_chat_template(prompt + completion, tokenize=False, **chat_template_kwargs)
            )
        else:
            texts.append(prompt + completion)
    return texts


class RewardModel:
    """A reward function that scores completions with a sequence-classification model.

    Each completion is scored on prompt + completion as TRL does (the chat template for
    conversational rows); the reward is the model's logit 0.

    Args:
        model: a ``PreTrainedModel`` for sequence classification, or a hub id / local path, loaded with
            ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **model_kwargs)``
            as TRL does.
        tokenizer: the reward model's own tokenizer (TRL's ``reward_processing_classes``); None loads
            it from the model's path.
        batch_size: completions per forward.
        chat_template_kwargs: passed to the chat template of conversational rows.
        model_kwargs: keyword arguments of ``from_pretrained`` when ``model`` is a path.

    ``__name__`` is the last part of the model's ``config._name_or_path`` (TRL's reward name, so
    metrics read ``rewards/<name>/mean``), or the model's class name when it has none.

    Example:
        >>> from lora_grpo.rewards import RewardModel
        >>> scorer = RewardModel("my-org/my-reward-model", batch_size=16)  # doctest: +SKIP
        >>> trainer = GRPOTrainer(config, reward_funcs=[scorer, "format"], train_dataset=ds)  # doctest: +SKIP

        In a recipe: ``reward_funcs: [{name: reward_model, kwargs: {model: my-org/my-reward-model}}]``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        batch_size: int = 32,
        chat_template_kwargs: dict | None = None,
        model_kwargs: dict | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        loaded = isinstance(model, (str, os.PathLike))
        # loaded here in its checkpoint's dtype: a trainer casts it to the run's, unless model_kwargs chose one
        # (a dtype, or a quantization, which transformers refuses to cast)
        self.castable = loaded and not {"dtype", "torch_dtype", "quantization_config"} & set(
            model_kwargs or {}
        )
        if loaded:
            with loading("reward model", "model", model):
                model = AutoModelForSequenceClassification.from_pretrained(
                    str(model), num_labels=1, **(model_kwargs or {})
                )
        source = str(getattr(model.config, "_name_or_path", "") or "")
        if tokenizer is None:
            if not source:
                raise ValueError(
                    "RewardModel: the model has no config._name_or_path to load its tokenizer from; pass "
                    "tokenizer= (the reward model's own tokenizer)"
                )
            with loading("reward model", "tokenizer", source):
                # at the model's revision, with its trust_remote_code, as TRL loads a reward model's tokenizer
                tokenizer = AutoTokenizer.from_pretrained(
                    source,
                    **{
                        k: v
                        for k, v in (model_kwargs or {}).items()
                        if k in ("revision", "trust_remote_code")
                    },
                )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # The model reads the reward at the last token that is not padding: it must know the pad id.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = batch_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = source.rstrip("/").split("/")[-1] or type(model).__name__

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r}, batch_size={self.batch_size})"

    @torch.no_grad()
    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs) -> list[float]:
        """One reward per completion: the model's logit 0 on prompt + completion (other keywords ignored)."""
        texts = _texts(self.tokenizer, prompts, completions, self.chat_template_kwargs)
        self.model.eval()  # dropout off, whatever the caller did with the model since
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                text=texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.model.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores
