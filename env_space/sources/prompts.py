"""Chat-formatted prompts for the external sources.

Sources describe a prompt as chat messages (``[{"role": "system", ...}, {"role": "user", ...}]``).
The replicas take a plain string, so the environment renders the messages once, when
it makes the task: with the chat template of a tokenizer (the policy model's, e.g.
``Qwen/Qwen3-0.6B``, loaded once through ``transformers``), or, without one, as the
message texts separated by blank lines (for base models).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["Messages", "render_prompt"]

Messages = list[dict[str, Any]]


@functools.lru_cache(maxsize=4)
def _tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def render_prompt(messages: Messages, chat_template: str = "") -> str:
    """Render chat messages as the prompt string the replicas complete.

    Args:
        messages: Chat messages (``role`` and ``content``).
        chat_template: A model id or local path whose tokenizer's chat template is used
            (with the generation prompt added); ``""``: the contents joined by blank lines.

    Returns:
        The prompt.

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not chat_template:
        return "\n\n".join(str(m["content"]) for m in messages) + "\n"
    tokenizer = _tokenizer(chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {chat_template!r} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
