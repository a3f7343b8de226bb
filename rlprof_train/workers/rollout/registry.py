"""The one registry of rollout backends: a name, what the backend reads and returns, and a factory.

::

    @register_rollout("echo")
    class EchoRollout(Rollout):
        def __init__(self, context: RolloutContext): ...
        def generate(self, prompts, sampling): ...

The name becomes a valid ``actor_rollout_ref.rollout.name``; the factory (a :class:`Rollout` subclass or any
function ``(RolloutContext) -> Rollout``) is what the trainer starts. What the trainer, ``tune`` and ``rlprof report``
need to know about a backend is a property of its registration, never a test of its name:

- ``reads``: the engine settings of ``actor_rollout_ref.rollout`` it uses, beyond the sampling settings every
  backend reads (``n``, ``temperature``, ``top_p``, ``top_k``, ``response_length``). A setting another backend
  reads and this one does not is named once in the log when it is not at its default; ``tune`` searches only the
  settings the backend reads; the run record lists them for ``rlprof report``'s advice.
- ``returns_log_probs``: the backend puts the sampling distribution's log-probs of the responses in
  ``batch.extras["rollout_log_probs"]`` ([B, T], zero outside the response mask). The trainer then logs
  ``rollout/log_prob_abs_diff`` against the actor's and keeps the old-log-prob pass.
- ``log_probs_on_request``: the backend returns them (as above) when :attr:`RolloutContext.wants_log_probs`: the run's
  rollout correction (``algorithm.rollout_correction``) needs them. A correction on a backend with neither is refused
  when the config is validated.
- ``continues``: the backend is a :class:`~rlprof_train.workers.rollout.base.ContinuingRollout`: it can continue
  token sequences, so multi-turn rollouts (``rollout.multi_turn.enable``) run on it; a config asking for them on a
  backend without it is refused when it is validated.
- ``preflight``: ``(TrainerConfig) -> problem or None``, run when the config is validated, before any model loads
  (e.g. "vLLM is not installed").

The contract of the backend itself is :class:`~rlprof_train.workers.rollout.base.Rollout`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, TypeVar

from rlprof.typed_config import ConfigError
from rlprof_train.config.schema import RolloutConfig, TrainerConfig
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.rollout.base import ContinuingRollout, Rollout

T = TypeVar("T")
KEY = "actor_rollout_ref.rollout.name"


class Policy(Protocol):
    """Where a backend reads the policy's weights: the trainer's actor (``ActorWorker``), or a rollout process's own
    copy of them (:mod:`rlprof_train.rollout_pool`)."""

    @property
    def module(self) -> Any: ...


@dataclass(frozen=True)
class RolloutContext:
    """What a backend is built from."""

    cfg: TrainerConfig
    """The run's whole configuration (the backend's own block: ``cfg.actor_rollout_ref.rollout``)."""
    env: DistEnv
    """This process's rank, world size and collectives."""
    model_path: str
    """The policy's model directory (the same on every rank)."""
    actor: Policy
    """The policy: ``actor.module`` holds its current weights (gathered under ZeRO 3 with
    ``deepspeed.zero.GatheredParameters``); a backend with its own copy reloads them in ``sync_weights``."""
    tokenizer: Any
    """The policy's tokenizer (``pad_token_id`` and ``eos_token_id`` set)."""
    log: Callable[[str], None]
    """One line to the trainer's log (rank 0 prints it)."""
    wants_log_probs: bool = False
    """The trainer needs the sampling distribution's log-probs of the responses (its rollout correction)."""


@dataclass(frozen=True)
class RolloutSpec:
    name: str
    factory: Callable[[RolloutContext], Rollout]
    title: str
    """How the log names the backend (``vLLM``)."""
    reads: tuple[str, ...]
    """The engine settings of ``actor_rollout_ref.rollout`` it uses (see the module doc)."""
    returns_log_probs: bool
    """It fills ``batch.extras["rollout_log_probs"]``."""
    preflight: Optional[Callable[[TrainerConfig], Optional[str]]]
    continues: bool = False
    """It continues token sequences (a ``ContinuingRollout``): multi-turn rollouts run on it."""
    log_probs_on_request: bool = False
    """It fills ``batch.extras["rollout_log_probs"]`` when :attr:`RolloutContext.wants_log_probs`."""
    engine_profiler: bool = False
    """Its engine runs the profiler the tool asks of engines (the torch tool's ``engine_profiler``: vLLM's own torch
    profiler) over the profiled steps, which honours the rollout's token window (``profile_token_start``/``_end``)."""
    pooled: bool = False
    """The one-step-off trainer's rollout pool runs it, on the pool's copy of the policy (:mod:`rlprof_train.
    rollout_pool`: ``sync_weights`` after each copy received); the others are refused for that trainer."""

    @property
    def can_return_log_probs(self) -> bool:
        return self.returns_log_probs or self.log_probs_on_request


_ROLLOUTS: dict[str, RolloutSpec] = {}


def register_rollout(
    name: str,
    *,
    title: Optional[str] = None,
    reads: tuple[str, ...] = (),
    returns_log_probs: bool = False,
    preflight: Optional[Callable[[TrainerConfig], Optional[str]]] = None,
    continues: bool = False,
    log_probs_on_request: bool = False,
    engine_profiler: bool = False,
    pooled: bool = False,
) -> Callable[[T], T]:
    """Register a :class:`Rollout` subclass taking a :class:`RolloutContext` (or a factory function) as ``name``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_rollout: name={name!r} must be an identifier such as 'hf' or 'my_engine'")
    settings = {f.name for f in dataclasses.fields(RolloutConfig)}
    unknown = [key for key in reads if key not in settings]
    if unknown:
        raise ValueError(f"register_rollout({name!r}): reads={unknown} are not keys of actor_rollout_ref.rollout")

    def register(factory: T) -> T:
        if not callable(factory):
            raise TypeError(f"register_rollout({name!r}): {factory!r} is neither a Rollout class nor a factory")
        if isinstance(factory, type) and not issubclass(factory, Rollout):
            raise TypeError(f"register_rollout({name!r}): {factory.__name__} does not subclass Rollout")
        if continues and isinstance(factory, type) and not issubclass(factory, ContinuingRollout):
            raise TypeError(
                f"register_rollout({name!r}, continues=True): {factory.__name__} does not subclass ContinuingRollout"
            )
        _ROLLOUTS[name] = RolloutSpec(
            name,
            factory,
            title or name,
            tuple(reads),
            returns_log_probs,
            preflight,
            continues,
            log_probs_on_request,
            engine_profiler,
            pooled,
        )
        return factory

    return register


def rollout_names() -> list[str]:
    return list(_ROLLOUTS)


def rollout_spec(name: str) -> RolloutSpec:
    try:
        return _ROLLOUTS[name]
    except KeyError:
        raise ConfigError(
            f"{KEY}: {name!r} is not a registered rollout; choose one of: {', '.join(rollout_names())}"
        ) from None


def check_rollout(cfg: TrainerConfig) -> None:
    """The backend is registered, continues sequences when the rollout is multi-turn, and its preflight finds nothing
    (a :class:`ConfigError` naming the key)."""
    name = cfg.actor_rollout_ref.rollout.name
    spec = rollout_spec(name)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable and not spec.continues:
        able = ", ".join(n for n, s in _ROLLOUTS.items() if s.continues)
        raise ConfigError(
            f"{KEY}={name!r}: actor_rollout_ref.rollout.multi_turn.enable=true needs a backend that continues token "
            f"sequences (registered with continues=True): {able}"
        )
    problem = spec.preflight(cfg) if spec.preflight else None
    if problem:
        raise ConfigError(f"{KEY}={name!r}: {problem}")


def create_rollout(context: RolloutContext) -> Rollout:
    """Start the backend named by the config; the instance's ``name`` is the registered one."""
    spec = rollout_spec(context.cfg.actor_rollout_ref.rollout.name)
    rollout = spec.factory(context)
    rollout.name = spec.name
    if spec.continues and not isinstance(rollout, ContinuingRollout):
        rollout.close()
        raise TypeError(
            f"register_rollout({spec.name!r}, continues=True): its factory made a {type(rollout).__name__}, which "
            "does not subclass ContinuingRollout"
        )
    return rollout


def ignored_settings(spec: RolloutSpec, rollout: RolloutConfig) -> list[str]:
    """One line per other backend whose engine settings this one does not read and the config changed."""
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
    lines = []
    for other in _ROLLOUTS.values():
        changed = [
            f"{key}={getattr(rollout, key)}"
            for key in other.reads
            if key not in spec.reads and getattr(rollout, key) != defaults[key]
        ]
        if other is not spec and changed:
            lines.append(
                f"rollout: the {spec.name} backend ignores the {other.title} engine settings {', '.join(changed)}"
            )
    return lines


def backend_facts(spec: RolloutSpec) -> dict[str, Any]:
    """What the run record says about the backend (``run.json``: ``rollout``), for ``rlprof report``."""
    return {"name": spec.name, "reads": list(spec.reads), "returns_log_probs": spec.returns_log_probs}
