"""Running tool methods for a rollout: each call on a thread of its own, inside the rlprof range ``tool/<name>``
(role ``tool``), with a deadline; the lifecycle methods (``create``, ``calc_reward``, ``release``: bookkeeping, one
per trajectory) on a small pool of reused threads, with the same deadline. A method that is a coroutine (verl's
tools are ``async def``) runs on one event loop the runner keeps (a thread), so tools that hold loop-bound resources
keep working between calls.

A call past its deadline gets an error reply and counts as failed; a coroutine is then cancelled, while a plain
function cannot be stopped from outside and finishes on its own (daemon) thread, its result dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import rlprof
from rlprof_train.agent.tool import Tool, ToolResponse

TOOL_ROLE = "tool"
LIFECYCLE_THREADS = 4


@dataclass(frozen=True)
class CallResult:
    """What one call came to: the reply put into the conversation, its step reward, how long it took."""

    name: str
    text: str
    reward: float
    seconds: float
    error: Optional[str] = None
    """Why the call failed (raised, timed out, unknown tool, malformed); None when it ran."""


class ToolRunner:
    """Calls the methods of ``tools`` with ``timeout_s`` each."""

    def __init__(self, tools: list[Tool], timeout_s: float) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s = timeout_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._lifecycle = ThreadPoolExecutor(max_workers=LIFECYCLE_THREADS, thread_name_prefix="rlprof-tool-lifecycle")

    def invoke(self, method: Callable[..., Any], *args: Any, deadline: float, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on this thread, a coroutine awaited on the runner's loop, by ``deadline``
        (``time.monotonic()``); TimeoutError past it."""
        result = method(*args, **kwargs)
        if not inspect.isawaitable(result):
            return result
        future = asyncio.run_coroutine_threadsafe(_awaited(result), self._event_loop())
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            future.cancel()
            raise

    def call_within(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A lifecycle ``method`` on the runner's pool, its result by the timeout (TimeoutError past it)."""
        deadline = time.monotonic() + self.timeout_s
        future = self._lifecycle.submit(self.invoke, method, *args, deadline=deadline, **kwargs)
        return future.result(timeout=max(0.0, deadline - time.monotonic()))

    def create(self, name: str, tools_kwargs: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
        """``(instance id, None)`` of a new instance of tool ``name`` (its ``create_kwargs`` from ``tools_kwargs``),
        or ``(None, why it failed)``."""
        try:
            instance, _ = self.call_within(self.tools[name].create, create_kwargs=tools_kwargs.get("create_kwargs", {}))
        except Exception as exc:
            return None, f"creating the tool failed: {type(exc).__name__}: {exc}"
        return str(instance), None

    def finish(self, name: str, instance: str, tools_kwargs: dict[str, Any]) -> float:
        """The instance's ``calc_reward`` (0.0 when it fails), then its ``release`` (a failure there leaks the
        tool's own state, not the run's)."""
        tool = self.tools[name]
        try:
            score = float(self.call_within(tool.calc_reward, instance, **tools_kwargs.get("calc_reward_kwargs", {})))
        except Exception:
            score = 0.0
        with contextlib.suppress(Exception):
            self.call_within(tool.release, instance, **tools_kwargs.get("release_kwargs", {}))
        return score

    def execute(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[CallResult]:
        """Run ``(tool name, instance id, arguments)`` calls at once; a result for each, in order."""
        deadline = time.monotonic() + self.timeout_s
        boxes: list[Future[CallResult]] = []
        for name, instance_id, arguments in calls:
            box: Future[CallResult] = Future()
            boxes.append(box)
            thread = threading.Thread(
                target=self._execute_one, args=(name, instance_id, arguments, deadline, box), daemon=True
            )
            thread.name = f"rlprof-tool-{name}"
            thread.start()
        results = []
        for (name, _, _), box in zip(calls, boxes, strict=True):
            try:
                results.append(box.result(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                message = f"the call took longer than multi_turn.tool_timeout_s={self.timeout_s:g} s"
                results.append(CallResult(name, f"Error when executing tool: {message}", 0.0, self.timeout_s, message))
        return results

    def _execute_one(
        self, name: str, instance_id: str, arguments: dict[str, Any], deadline: float, box: Future[CallResult]
    ) -> None:
        start = time.perf_counter()
        tool = self.tools[name]
        with rlprof.profile_range(name, role=TOOL_ROLE):
            try:
                reply, reward, _ = self.invoke(tool.execute, instance_id, arguments, deadline=deadline)
                text = reply.text if isinstance(reply, ToolResponse) else str(reply)
                result = CallResult(name, text, float(reward or 0.0), time.perf_counter() - start)
            except Exception as exc:  # the tool's own failure becomes its reply, as in verl
                if isinstance(exc, TimeoutError) and time.monotonic() >= deadline:
                    return  # past the deadline: the waiting thread has answered it already
                error = f"{type(exc).__name__}: {exc}"
                result = CallResult(
                    name, f"Error when executing tool: {error}", 0.0, time.perf_counter() - start, error
                )
        box.set_result(result)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="rlprof-tool-loop", daemon=True)
            self._loop_thread.start()
        return self._loop

    def close(self) -> None:
        """Stop the lifecycle pool (a method still running finishes on its own) and the event loop, if started."""
        self._lifecycle.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
            self._loop = None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
