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
"""

from rlprof.annotate import profile_range, profiled
from rlprof.config import ConfigError, ProfilerConfig, load_config
from rlprof.session import Session, get_session, init, shutdown, step

__all__ = [
    "ConfigError",
    "ProfilerConfig",
    "Session",
    "get_session",
    "init",
    "load_config",
    "profile_range",
    "profiled",
    "shutdown",
    "step",
]
__version__ = "0.1.0"
