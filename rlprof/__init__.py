"""rlprof: profile RL training of LLMs with Nsight Systems ranges, torch.profiler windows and memory snapshots.

Decorate once, choose by config::

    import rlprof

    @rlprof.profiled(role="actor")
    def update_actor(batch): ...

    rlprof.init({"global_profiler": {"tool": "torch", "steps": [2, 3]}})
    for n in range(1, 6):
        with rlprof.step(n):
            with rlprof.profile_range("generate", role="rollout"):
                ...
            update_actor(batch)
    rlprof.shutdown()

Extending: a recording tool is a :class:`rlprof.tools.Tool` registered with :func:`register_tool`.
"""

from rlprof.annotate import mini_batch, profile_range, profiled
from rlprof.session import get_session, init, is_recording, shutdown, step
from rlprof.timer import marked_timer
from rlprof.tools import register_tool
from rlprof.typed_config import ConfigError
from rlprof.watchdog import watchdog

__all__ = [
    "ConfigError",
    "get_session",
    "init",
    "is_recording",
    "marked_timer",
    "mini_batch",
    "profile_range",
    "profiled",
    "register_tool",
    "shutdown",
    "step",
    "watchdog",
]
__version__ = "0.1.0"
