"""The math of a GRPO step as pure tensor functions: advantages, the loss and its types, chunked log-probs.

Imports nothing of lora_grpo's: each function takes and returns tensors, tested against hand-computed values.
"""
