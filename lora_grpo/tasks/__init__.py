"""The offline tasks: data, rewards and tiny base models generated locally (nothing is downloaded).

    toy            two-digit addition and the tiny Llama-style base pre-trained on it (the default recipe)
    countdown      reach a target from 3–4 numbers with + − × ÷ (TinyZero's task, generated here)
    calculator     3–4 digit sums with a calculator tool, and a tiny base pre-trained to call it sometimes
                   (the toy-calculator recipe: GRPO teaches it to call the tool and copy the result)
    countdown_toy  countdown shrunk for a tiny model: three one-digit numbers, + − ×, and a tiny base
                   pre-trained to swap + and − often (the toy-countdown recipe: GRPO teaches it not to)
    chat_arithmetic one-digit sums in ten phrasings through a chat template, for a real instruct model
                   (the smollm2-135m-chat-sum recipe: GRPO teaches SmolLM2-135M-Instruct to answer before
                   its budget runs out)

`dataset: toy` / `countdown` / `calculator` / `countdown-toy` / `chat-sum` in a recipe name them
(data.LOCAL_DATASETS); `model_name_or_path: toy` / `toy-calculator` / `toy-countdown` name the bases
(bases.local_base).
"""
