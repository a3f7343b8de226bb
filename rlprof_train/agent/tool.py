"""A tool a multi-turn rollout can call, with verl's lifecycle (``verl.tools.base_tool.BaseTool``).

Per trajectory, for each tool the policy may call: ``create`` an instance (with the prompt's
``extra_info.tools_kwargs[name].create_kwargs``); ``execute`` it once per call with the call's arguments, which
returns the reply put back into the conversation, a step reward and metrics; at the end ``calc_reward`` (the tool's
own reward for the trajectory, handed to the reward function as ``extra_info["rollout_reward_scores"]``, as verl
does) and ``release``. Each method may be a plain function or a coroutine (verl's tools are ``async def``); a verl
tool ported here changes its imports only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ToolResponse:
    """What a call puts back into the conversation (verl's ``ToolResponse``; text only here)."""

    text: str = ""


class Tool:
    """Base class of the tools a tool config names by ``class_name``: ``Tool(config, tool_schema)``.

    ``tool_schema`` is the OpenAI function schema of the config (``{"type": "function", "function": {"name": ...,
    "description": ..., "parameters": {...}}}``); ``name`` is its function name, the name the policy calls.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config = config
        self.tool_schema = tool_schema
        self.name: str = tool_schema["function"]["name"]

    def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance for one trajectory; returns its id (and a reply verl ignores)."""
        return instance_id or uuid.uuid4().hex, ToolResponse()

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict[str, Any]]:
        """Run one call: ``(reply, step reward, metrics)``; the reply a :class:`ToolResponse` or a string."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The tool's reward for the trajectory, at its end."""
        return 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free what the instance holds."""
