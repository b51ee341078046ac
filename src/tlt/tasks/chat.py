"""Prompts go through the tokenizer's chat template, exactly as at inference and drafter warm-up."""

from __future__ import annotations

from tlt.errors import TltError


def chat_prompt_ids(tokenizer, prompt: str, system_prompt: str | None = None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise TltError("the tokenizer has no chat template: tlt formats every prompt with it")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
