"""Multi-turn, tool-calling rollout (``actor_rollout_ref.rollout.multi_turn.enable``), on any backend that can
continue token sequences (a :class:`~rlprof_train.workers.rollout.base.ContinuingRollout`: hf and vllm).

Each trajectory, as verl's tool agent loop runs it::

    prompt (chat template with the tools' schemas) -> generate until EOS or the response length
      -> the turn's text has tool calls (hermes format)?  no: done
      -> run them (the first max_parallel_calls; each with tool_timeout_s), the replies as "tool" messages through
         the chat template -> appended (not the policy's tokens) -> generate again ...

until ``max_assistant_turns`` generation turns, ``max_user_turns`` reply turns, or the response length (a reply that
would not fit ends the trajectory, as in verl). All trajectories of the batch advance together: one ``complete`` call
per turn for those still going, then every call of the turn at once (:class:`~rlprof_train.agent.runner.ToolRunner`).

The batch holds, per trajectory, every token after the prompt: ``response_mask`` marks the policy's (the losses
cover those only), ``attention_mask`` all of them, so log-probs are recomputed over the whole conversation. The
reward function gets verl's ``extra_info`` keys: ``num_turns``, ``tool_rewards`` (each call's step reward) and
``rollout_reward_scores`` (each tool's ``calc_reward`` at the end).

Profiling: each generation turn is the range ``rollout/gen_turn``, each tool call ``tool/<name>`` (role ``tool``,
which follows the rollout role's block); the step's turns, calls and time split are metrics
(:mod:`rlprof_train.agent.stats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

import rlprof
from rlprof_train.agent.parser import ToolCall, parse_hermes
from rlprof_train.agent.runner import CallResult, ToolRunner
from rlprof_train.agent.stats import MALFORMED, RolloutSplit, ToolCallRecord, TrajectoryRecord
from rlprof_train.agent.tool import Tool
from rlprof_train.batch import RolloutBatch
from rlprof_train.config.schema import MultiTurnConfig
from rlprof_train.data import Example, left_pad
from rlprof_train.workers.rollout.base import (
    Completions,
    ContinuingRollout,
    Rollout,
    SamplingParams,
    prompt_keys,
    trajectory_keys,
)


@dataclass
class Segments:
    """Partial rollouts (the fully-async trainer's ``partial_rollout``): a call samples at most ``size`` tokens of a
    trajectory, and a turn cut there goes on in the next call (counted as one turn, its tool calls read once it ends);
    after each call ``between(sampled, going)`` runs with the trajectories that sampled in it and those still going
    (the rollout process takes the orders waiting there: a weight sync pauses the batch, which goes on with the new
    weights)."""

    size: int
    between: Callable[[list[int], list[int]], None]


@dataclass
class Trajectory:
    """One conversation being rolled out: the tokens after its prompt and whose they are."""

    prompt: Example
    response: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)
    """1 for each token the policy sampled, 0 for tool replies and template tokens."""
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)
    """Tool name -> the instance created for this trajectory (at its first call of that tool)."""
    seconds: float = 0.0

    def extend(self, tokens: Sequence[int], by_policy: bool, log_probs: Optional[Sequence[float]] = None) -> None:
        self.response += tokens
        self.policy += [int(by_policy)] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


def truncate_reply(text: str, limit: int, side: str) -> str:
    """verl's cut of a tool reply longer than ``limit`` characters: keep its start (left), its end (right) or both
    halves (middle), marked ``(truncated)``."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolReplies:
    """Tool replies as the tokens that follow an assistant turn: the chat template's ``tool`` messages and its
    generation prompt, without the system prompt the template puts first (verl's ``remove_system_prompt``); a
    tokenizer without a chat template gets hermes' ``<tool_response>`` blocks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.system_prefix = ""
        if self.templated:
            one = self._render([{"role": "user", "content": ""}], generation_prompt=False)
            two = self._render([{"role": "user", "content": ""}] * 2, generation_prompt=False)
            self.system_prefix = one[: len(one) - (len(two) - len(one))]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        )

    def tokens(self, texts: Sequence[str]) -> list[int]:
        if self.templated:
            text = self._render([{"role": "tool", "content": t} for t in texts], generation_prompt=True)
            text = text.removeprefix(self.system_prefix)
        else:
            text = "".join(f"\n<tool_response>\n{t}\n</tool_response>" for t in texts) + "\n"
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids


class MultiTurnRollout(Rollout):
    """Rolls ``backend`` out over several turns, calling ``tools`` (see the module doc)."""

    def __init__(
        self, backend: ContinuingRollout, tools: list[Tool], settings: MultiTurnConfig, tokenizer: Any
    ) -> None:
        self.backend = backend
        self.name = backend.name
        self.settings = settings
        self.tokenizer = tokenizer
        self.runner = ToolRunner(tools, settings.tool_timeout_s)
        self.replies = ToolReplies(tokenizer)
        self.segments: Optional[Segments] = None
        """Set by a rollout process sampling partial rollouts (:mod:`rlprof_train.rollout_stream`)."""

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        limit, n = sampling.response_length, sampling.n
        trajectories = [Trajectory(p) for p in prompts for _ in range(n)]
        keys = prompt_keys(prompts, sampling)
        calls: list[ToolCallRecord] = []
        sampled: list[Completions] = []
        generating_s = tool_wait_s = 0.0
        active = list(range(len(trajectories)))
        segment = self.segments.size if self.segments is not None else limit
        eos = self.tokenizer.eos_token_id
        turn_tokens: dict[int, list[int]] = {}  # a turn cut by a segment: its tokens so far
        while active:
            turn_start = time.perf_counter()
            budgets = [min(segment, limit - len(trajectories[i].response)) for i in active]
            with rlprof.profile_range("gen_turn", role="rollout"):
                if not sampled:  # the first turn: each prompt once, its n trajectories sampled together
                    contexts = [p.prompt_ids for p in prompts]
                    done = self.backend.complete(contexts, n, budgets[::n], sampling, keys)
                else:
                    contexts = [(*trajectories[i].prompt.prompt_ids, *trajectories[i].response) for i in active]
                    done = self.backend.complete(contexts, 1, budgets, sampling, trajectory_keys(keys, n, active))
            sampled.append(done)
            generating_s += time.perf_counter() - turn_start
            wanted: list[tuple[int, list[ToolCall]]] = []
            cut: list[int] = []
            for index, budget, completion in zip(active, budgets, done.rows, strict=True):
                trajectory = trajectories[index]
                trajectory.extend(completion.token_ids, True, completion.log_probs)
                turn = turn_tokens.pop(index, []) + list(completion.token_ids)
                if len(completion.token_ids) == budget and len(trajectory.response) < limit and turn[-1:] != [eos]:
                    turn_tokens[index] = turn  # the segment (not the length) ended it mid-turn: it goes on next call
                    cut.append(index)
                    continue
                trajectory.assistant_turns += 1
                found = [] if self._over(trajectory, limit) else parse_hermes(self.tokenizer.decode(turn))
                trajectory.tool_calls += len(found)
                if found:
                    wanted.append((index, found[: self.settings.max_parallel_calls]))
                else:
                    trajectory.seconds = time.perf_counter() - start
            tools_start = time.perf_counter()
            results = self._call(trajectories, wanted, calls)
            tool_wait_s += time.perf_counter() - tools_start
            sampled_now, active = active, list(cut)
            active += self._reply(trajectories, wanted, results, limit, start)
            active.sort()
            if self.segments is not None:
                self.segments.between(sampled_now, active)
        scores = [self._finish(t) for t in trajectories]
        split = RolloutSplit(time.perf_counter() - start, generating_s, tool_wait_s)
        return self._batch(trajectories, scores, sampling, sampled, calls, split)

    def _reply(
        self,
        trajectories: list[Trajectory],
        wanted: list[tuple[int, list[ToolCall]]],
        results: list[list[CallResult]],
        limit: int,
        start: float,
    ) -> list[int]:
        """Each calling trajectory's tool replies appended (a reply that would not fit ends it, as in verl): the
        trajectories that go on to another turn."""
        going = []
        for (index, _), replies in zip(wanted, results, strict=True):
            trajectory = trajectories[index]
            tokens = self.replies.tokens(
                [
                    truncate_reply(
                        r.text, self.settings.max_tool_response_length, self.settings.tool_response_truncate_side
                    )
                    for r in replies
                ]
            )
            trajectory.tool_rewards += [r.reward for r in replies if r.error is None]
            if len(trajectory.response) + len(tokens) >= limit:  # the reply would not fit: verl ends here
                trajectory.seconds = time.perf_counter() - start
                continue
            trajectory.extend(tokens, False)
            trajectory.user_turns += 1
            going.append(index)
        return going

    def _over(self, trajectory: Trajectory, limit: int) -> bool:
        """Whether the trajectory ends after this generation turn whatever it says (verl's order of checks)."""
        most_assistant, most_user = self.settings.max_assistant_turns, self.settings.max_user_turns
        return (
            len(trajectory.response) >= limit
            or (most_assistant is not None and trajectory.assistant_turns >= most_assistant)
            or (most_user is not None and trajectory.user_turns >= most_user)
        )

    def _call(
        self, trajectories: list[Trajectory], wanted: list[tuple[int, list[ToolCall]]], records: list[ToolCallRecord]
    ) -> list[list[CallResult]]:
        """Every wanted call of the turn at once; unusable ones answered with their error, without running."""
        results: list[list[Optional[CallResult]]] = [[None] * len(found) for _, found in wanted]
        runnable: list[tuple[int, int, tuple[str, str, dict[str, Any]]]] = []
        for slot, (index, found) in enumerate(wanted):
            for position, call in enumerate(found):
                problem = call.error or self._unknown(call.name)
                if problem is None:
                    instance, problem = self._instance(trajectories[index], call.name)
                    if instance is not None:
                        runnable.append((slot, position, (call.name, instance, call.arguments)))
                        continue
                name = call.name if call.name in self.runner.tools else MALFORMED
                results[slot][position] = CallResult(name, f"Error when executing tool: {problem}", 0.0, 0.0, problem)
        with rlprof.profile_range("tool_calls", role="rollout"):
            ran = self.runner.execute([call for _, _, call in runnable])
        for (slot, position, _), result in zip(runnable, ran, strict=True):
            results[slot][position] = result
        complete = [[r for r in row if r is not None] for row in results]
        records += [ToolCallRecord(r.name, r.seconds, r.error is not None) for row in complete for r in row]
        return complete

    def _unknown(self, name: str) -> Optional[str]:
        if name in self.runner.tools:
            return None
        return f"there is no tool {name!r}; the tools are: {', '.join(sorted(self.runner.tools)) or 'none'}"

    def _instance(self, trajectory: Trajectory, name: str) -> tuple[Optional[str], Optional[str]]:
        """The trajectory's instance of tool ``name``, created at its first call: ``(id, None)`` or ``(None, why)``."""
        if name not in trajectory.instances:
            instance, problem = self.runner.create(name, trajectory.prompt.tools_kwargs.get(name, {}))
            if instance is None:
                return None, problem
            trajectory.instances[name] = instance
        return trajectory.instances[name], None

    def _finish(self, trajectory: Trajectory) -> dict[str, float]:
        """Each created tool's reward for the trajectory (its instance then released)."""
        return {
            name: self.runner.finish(name, instance, trajectory.prompt.tools_kwargs.get(name, {}))
            for name, instance in trajectory.instances.items()
        }

    def _batch(
        self,
        trajectories: list[Trajectory],
        scores: list[dict[str, float]],
        sampling: SamplingParams,
        sampled: list[Completions],
        calls: list[ToolCallRecord],
        split: RolloutSplit,
    ) -> RolloutBatch:
        pad, width = self.tokenizer.pad_token_id, sampling.response_length
        prompt_ids, prompt_mask = left_pad([t.prompt.prompt_ids for t in trajectories], pad)

        def right(rows: list[list[Any]], fill: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([[*r, *[fill] * (width - len(r))] for r in rows], dtype=dtype).reshape(len(rows), width)

        responses = right([t.response for t in trajectories], pad, torch.long)
        real = right([[1] * len(t.response) for t in trajectories], 0, torch.long)
        policy = right([t.policy for t in trajectories], 0, torch.long)
        batch = RolloutBatch(
            input_ids=torch.cat([prompt_ids, responses], dim=1),
            attention_mask=torch.cat([prompt_mask, real], dim=1),
            response_mask=policy,
            prompt_length=prompt_ids.shape[1],
            uid=[t.prompt.index for t in trajectories],
            data_source=[t.prompt.data_source for t in trajectories],
            ground_truth=[t.prompt.ground_truth for t in trajectories],
            n=sampling.n,
            temperature=sampling.temperature,
        )
        if any(c.log_probs is not None for done in sampled for c in done.rows):
            batch.extras["rollout_log_probs"] = right([t.log_probs for t in trajectories], 0.0, torch.float32) * policy
        requests = [r for done in sampled for r in done.requests]
        if requests:
            batch.extras["engine_requests"] = requests
        occupancies = [done.occupancy for done in sampled if done.occupancy is not None]
        if occupancies:
            batch.extras["engine_occupancy"] = (sum(o[0] for o in occupancies), sum(o[1] for o in occupancies))
        kv_cache_usage = [u for done in sampled for u in done.kv_cache_usage]
        if kv_cache_usage:
            batch.extras["engine_kv_cache_usage"] = kv_cache_usage
        batch.extras["reward_extra_info"] = [
            {
                "num_turns": t.assistant_turns + t.user_turns + 1,
                "tool_rewards": list(t.tool_rewards),
                "rollout_reward_scores": score,
            }
            for t, score in zip(trajectories, scores, strict=True)
        ]
        batch.extras["multi_turn"] = {
            "trajectories": [
                TrajectoryRecord(t.assistant_turns + t.user_turns + 1, t.tool_calls, len(t.response), t.seconds)
                for t in trajectories
            ],
            "calls": calls,
            "splits": [split],
        }
        return batch

    def warm_up(self, prompts: list[Example], sampling: SamplingParams) -> bool:
        return self.backend.warm_up(prompts, sampling)

    def sync_weights(self) -> None:
        self.backend.sync_weights()

    def close(self) -> None:
        self.runner.close()
        self.backend.close()
