"""A chat's messages rendered into prompt text by the tokenizer's own chat template (Jinja).

The template's deliberate refusals (raise_exception: "roles must alternate") are the client's
to read, as a 400; any other failure inside it is logged and answered without its details.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import bad_request
from .protocol import shown

log = logging.getLogger("tokencache_serve")


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(
            "This model's tokenizer has no chat template; use /v1/completions.", "messages"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        from jinja2 import TemplateError

        if isinstance(e, TemplateError) and type(e).__name__ != "TemplateSyntaxError":
            msg = f"The chat template rejected the messages: {shown(str(e))}"
        else:
            log.warning("chat template failed", exc_info=e)
            msg = "The chat template could not render these messages."
        raise bad_request(msg, "messages") from None
    return str(text)
