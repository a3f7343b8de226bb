"""The tool calls in a turn's text, in the ``hermes`` format verl and vLLM parse:
``<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>``.

A call that cannot be used (not JSON, no ``name``, ``arguments`` not an object, a ``<tool_call>`` never closed) is
kept as a :class:`ToolCall` with its ``error``: the rollout answers it with that error as the tool's reply and
counts it, rather than ending the trajectory or failing the step.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)
MAX_CALL_CHARS = 65_536
"""A call's JSON longer than this is refused unread (a policy can write anything)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: a tool name and its arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of a call in the hermes format."""
    return START + json.dumps({"name": name, "arguments": arguments}) + END


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order, then an unclosed ``<tool_call>`` if one is left."""
    calls = [_read(body) for body in _CALL.findall(text)]
    tail = _CALL.sub("", text)
    if START in tail:
        calls.append(ToolCall("", error=f"{START} is never closed by {END}"))
    return calls


def _read(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall("", error=f"the call is {len(body)} characters long, over {MAX_CALL_CHARS}")
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ToolCall("", error=f"the call is not JSON ({exc.__class__.__name__}: {str(exc)[:80]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall("", error='the call has no "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error='the call\'s "arguments" is not an object')
    return ToolCall(call["name"], arguments)
