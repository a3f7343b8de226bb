"""Tool calling for the multi-turn rollout (``actor_rollout_ref.rollout.multi_turn``): the tools a policy calls
(:mod:`.tool`, :mod:`.builtin`), loaded from verl's tool YAML (:mod:`.tool_config`), the calls found in its text
(:mod:`.parser`), run with a timeout (:mod:`.runner`), and what a step's trajectories did (:mod:`.stats`). The loop
itself is :mod:`rlprof_train.workers.rollout.multi_turn`."""

from rlprof_train.agent.tool import Tool, ToolResponse

__all__ = ["Tool", "ToolResponse"]
