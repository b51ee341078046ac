"""Prompts go through the tokenizer's chat template, exactly as at inference and drafter warm-up."""

from __future__ import annotations

from tlt.errors import TltError, first_line


NO_TOKENIZER = ("the model has no tokenizer (its directory holds no tokenizer.json, tokenizer_config.json or "
                "tokenizer.model): copy the model's tokenizer files there")


def chat_prompt_ids(tokenizer, prompt: str, system_prompt: str | None = None) -> list[int]:
    if tokenizer is None:
        raise TltError(NO_TOKENIZER)
    if not getattr(tokenizer, "chat_template", None):
        raise TltError("the tokenizer has no chat template: tlt formats every prompt with it (give the model "
                       "directory a chat_template.jinja, or tokenizer_config.json a \"chat_template\")")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": prompt}]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as error:  # noqa: BLE001 - jinja's TemplateError, raised by the template itself
        if system_prompt and "system" in str(error).lower():
            raise TltError(f"task.system_prompt: the model's chat template refuses a system message "
                           f"({first_line(error)}); put the instructions in the prompts instead") from None
        raise TltError(f"the model's chat template failed on a prompt: {first_line(error)}") from None
    return list(ids)
