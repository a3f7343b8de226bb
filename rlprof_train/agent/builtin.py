"""The built-in tools: verl's GSM8K reward tool, and a calculator."""

from __future__ import annotations

import ast
import operator
import uuid
from collections.abc import Callable
from typing import Any, Optional

from rlprof_train.agent.tool import Tool, ToolResponse
from rlprof_train.reward_functions import gsm8k_score


class Gsm8kTool(Tool):
    """verl's ``verl.tools.gsm8k_tool.Gsm8kTool``: the policy submits an ``answer``; the reply says how it scored
    (``Current parsed answer='72' reward=1.0``). Scored as verl scores it: the last number of ``"#### " + answer``
    against the prompt's ``create_kwargs.ground_truth``. The step reward of a call is 0.0 when it raised the best score
    so far, -0.05 otherwise (verl's penalty for resubmitting without improving); ``calc_reward`` is the last score."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def create(
        self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict[str, Any]]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        truth = state["ground_truth"]
        return gsm8k_score(state["response"], str(truth), method="flexible") if truth is not None else 0.0

    def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**18


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression of numbers, ``+ - * / // % **`` and brackets; anything else (names,
    calls, huge powers) is a ValueError naming what is wrong. Nothing of the expression is run."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long, over {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > MAX_MAGNITUDE):
                raise ValueError("the power is too large")
            result = _OPERATORS[type(node.op)](left, right)
            if abs(result) > MAX_MAGNITUDE:
                raise ValueError("the result is too large")
            return result  # type: ignore[no-any-return]
        raise ValueError(f"{ast.unparse(node)!r} is not allowed: numbers and + - * / // % ** only")

    try:
        return value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


class CalculatorTool(Tool):
    """Evaluates the call's ``expression`` (``{"expression": "12*7"}``) and replies with the value (``84``; a whole
    float is written as an integer). A bad expression is an error reply."""

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict[str, Any]]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            raise ValueError('the call needs an "expression" string')
        result = evaluate(expression)
        text = str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)
        return ToolResponse(text=text), 0.0, {}


CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and brackets).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 12*7"}},
            "required": ["expression"],
        },
    },
}
