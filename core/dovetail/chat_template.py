"""A chat template given by the user (``--chat-template``) in place of the tokenizer's own.

As in vLLM, the value is a file holding the Jinja template, or the template itself. It is parsed once at
start-up, so a broken template stops the server with its line number before the model loads, instead of
failing every chat request.
"""

from __future__ import annotations

import os

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dovetail.errors import ConfigError

try:  # the environment transformers renders templates in (its extensions add tags such as {% generation %})
    from transformers.utils.chat_template_utils import _compile_jinja_template as _compile
except ImportError:
    def _compile(template: str):
        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(template)

#: What only a Jinja template, never a file name, contains.
TEMPLATE_MARKS = ("{{", "{%", "\n")


def load_chat_template(value: str | None, field: str = "--chat-template") -> str | None:
    """The template text of ``value`` (a file's path or the template itself), checked for Jinja syntax; None
    for None. A :class:`~dovetail.errors.ConfigError` naming ``field`` otherwise."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{field}: cannot read {value}: {exc}") from None
        where = f"{field} {value}"
    elif any(mark in value for mark in TEMPLATE_MARKS):
        template, where = value, field
    else:
        raise ConfigError(f"{field}: no file {value!r}, and with no '{{{{' or '{{%' in it, it is no template either")
    if not template.strip():
        raise ConfigError(f"{where}: the template is empty")
    try:
        _compile(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: line {exc.lineno}: {exc.message}") from None
    return template
