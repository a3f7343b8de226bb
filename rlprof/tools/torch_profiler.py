"""torch.profiler over each step window: one gzipped Chrome trace per window per rank.

Files: ``{save_path}/torch/step{S}[-{E}]/rank{R}.pt.trace.json.gz``. Each step of the window is a
``ProfilerStep#{step}`` span (training step numbers, not counted from 0), each range a
``record_function("role/name")``, and the trace carries ``distributedInfo`` (rank, world size) even without
torch.distributed, so Holistic Trace Analysis and TensorBoard's PyTorch profiler plugin read it.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, _ExperimentalConfig

from rlprof.tools.base import RangeSite, Tool, ToolContext

TRACE_SUFFIX = ".pt.trace.json.gz"


def _record_every_step(step: int) -> ProfilerAction:
    """A schedule that records every step; it makes torch emit the ``ProfilerStep#N`` spans."""
    return ProfilerAction.RECORD


class TorchProfilerTool(Tool):
    """Runs one ``torch.profiler.profile`` per step window."""

    name = "torch"

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        contents = set(context.config.global_profiler.global_tool_config.torch.contents)
        cuda = torch.cuda.is_available()
        activities = {ProfilerActivity.CPU} if "cpu" in contents or not contents & {"cpu", "cuda"} else set()
        if cuda and ("cuda" in contents or not contents & {"cpu", "cuda"}):
            activities.add(ProfilerActivity.CUDA)
        self.activities = sorted(activities, key=str)
        self.options = dict(
            record_shapes="shapes" in contents,
            with_stack="stack" in contents,
            profile_memory="memory" in contents,
            with_flops="flops" in contents,
            with_modules="modules" in contents,
        )
        self.profiler: Any = None

    def start_window(self, step: int) -> None:
        super().start_window(step)
        profiler = torch.profiler.profile(
            activities=self.activities,
            schedule=_record_every_step,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),  # rollout/reward threads too
            **self.options,
        )
        profiler.step_num = step
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            info = {"backend": "none", "rank": self.context.rank, "world_size": self.context.world_size}
            profiler.preset_metadata_json("distributedInfo", json.dumps(info))
        profiler.start()
        self.profiler = profiler

    def advance(self, step: int) -> None:
        super().advance(step)
        self.profiler.step()

    def stop_window(self) -> None:
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()
            folder = self.window_dir()
            folder.mkdir(parents=True, exist_ok=True)
            final = folder / f"rank{self.context.rank}{TRACE_SUFFIX}"
            tmp = folder / f".rank{self.context.rank}.{os.getpid()}.tmp{TRACE_SUFFIX}"
            profiler.export_chrome_trace(str(tmp))
            self.publish(tmp, final)
        finally:
            super().stop_window()

    def enter_range(self, site: RangeSite) -> Callable[[], Any]:
        handle = torch.ops.profiler._record_function_enter_new(site.label, None)
        return functools.partial(torch.ops.profiler._record_function_exit._RecordFunction, handle)

    def close(self) -> None:
        if self.profiler is not None:  # turned off mid-window: stop recording, write nothing
            profiler, self.profiler = self.profiler, None
            profiler.stop()
