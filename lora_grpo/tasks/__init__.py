"""The offline tasks: data, rewards and tiny base models generated locally (nothing is downloaded).

    toy        two-digit addition and the tiny Llama-style base pre-trained on it (the default recipe)
    countdown  reach a target from 3–4 numbers with + − × ÷ (TinyZero's task, generated here)
    calculator 3–4 digit sums with a calculator tool, and a tiny base pre-trained to call it sometimes
               (the toy-calculator recipe: GRPO teaches it to call the tool and copy the result)

`dataset: toy` / `dataset: countdown` in a recipe name them (data.LOCAL_DATASETS).
"""
