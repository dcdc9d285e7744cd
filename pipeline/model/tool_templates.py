"""Whether a model's own chat template renders tools, in the call format this server constrains.

The gateway always builds a tool request's prompt two ways (api/chat_messages.py): the fallback, plain
messages that any template renders, and the structured conversation with the OpenAI `tools` array.
Admission renders the structured form through the model's template only where that template takes
`tools` and teaches the Hermes `<tool_call>` blocks (Qwen 2.5, Qwen 3, Hermes, SmolLM3 and others):
the model then sees tools exactly as it was trained to, and the call grammar (api/tool_calls.py)
asks it for the same blocks. A template with another call format (Llama 3.1's JSON, Mistral's
[TOOL_CALLS]) would teach one format while the grammar forces another, so it gets the fallback.
"""

from __future__ import annotations

import jinja2
import jinja2.meta

CALL_BLOCK = "<tool_call>"


def renders_hermes_tools(template: str | None) -> bool:
    """True where the template reads the `tools` variable (jinja's own parse, so the word in its
    text does not count) and writes `<tool_call>` blocks."""
    if not template or CALL_BLOCK not in template:
        return False
    try:
        variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering it fails too, and says so where the request is refused
    return "tools" in variables
