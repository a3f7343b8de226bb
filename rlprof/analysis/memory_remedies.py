"""What to try when a pass runs out of memory: the seed's memory settings that act on the pass that failed (its role
and range), each an override to paste, ordered by the live bytes it acts on at the failure.

The live bytes at the failure (:class:`~rlprof.analysis.allocations.OomMoment`) are split three ways:

- **the pass's own**: allocated inside the failing role's ranges (its activations, its logits, what its backward
  made): gradient checkpointing, activation offload and smaller micro-batches or token budgets act on them;
- **entropy's**: those of them whose allocation site is in an entropy or log-softmax computation: entropy from logits
  with chunking, and entropy checkpointing, act on them;
- **held from before**: everything else (parameters, gradients, optimizer state, other passes' leftovers): parameter
  and optimizer offload act on them.

A request larger than the device's whole memory is met by no memory freed: then only the settings that make the
request itself smaller are offered (smaller micro-batches or token budgets for the pass; entropy chunking where the
request is the entropy's), acting on the request's bytes.

A setting already on (from the run's saved config, where there is one) is not offered; a micro-batch size is
halved from the run's own (without a run, only the settings that need no number are offered); an offload comes with
the ZeRO stage it needs where the run's is lower. A failing range that
is not an rlprof range (a snapshot of another program) gets the policy's training settings, the seed's first
remedies for an OOM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from rlprof.analysis.allocations import OomMoment, role_of

ACTOR = "actor_rollout_ref.actor"
MODEL = "actor_rollout_ref.model"
REF = "actor_rollout_ref.ref"
ROLLOUT = "actor_rollout_ref.rollout"
ENTROPY_SITES = ("entropy", "log_softmax", "logsumexp")
Setting = Callable[[str], Any]
"""A run's saved setting by dotted key (None where unknown)."""


@dataclass(frozen=True)
class Remedy:
    override: str
    """What to paste on the command line (one or more ``key=value``)."""
    acts_on: str
    """Which bytes it lowers, in words."""
    bytes: int
    """Live bytes of that kind at the failure."""


@dataclass(frozen=True)
class _Knob:
    kind: str
    """What it acts on: "pass", "entropy" or "held" (see the module doc)."""
    key: str
    """Set to true, or halved (``half``)."""
    half: bool = False
    stage: Optional[tuple[str, int]] = None
    """(the ZeRO stage's key, the lowest stage the setting works at)."""


def _per_micro_batch(setting: Setting, prefix: str, dynamic: str, tokens: str, rows: str) -> str:
    """The key that sizes the pass's micro-batches: its token budget when it cuts them by tokens, else its rows."""
    return f"{prefix}.{tokens}" if setting(f"{prefix}.{dynamic}") else f"{prefix}.{rows}"


def _knobs(tag: str, setting: Setting) -> tuple[list[_Knob], str]:
    """The knobs for the pass of range ``tag``, and the pass in words."""
    role, name = role_of(tag), tag.split("/", 1)[-1]
    log_prob = ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu")
    update = ("use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu")
    if role == "actor" and name in ("old_log_prob", "compute_log_prob"):
        size = _per_micro_batch(setting, ROLLOUT, *log_prob)
        return [_Knob("entropy", f"{ACTOR}.entropy_from_logits_with_chunking"), _Knob("pass", size, True)], tag
    if role == "ref":
        size = _per_micro_batch(setting, REF, *log_prob)
        return [_Knob("entropy", f"{REF}.entropy_from_logits_with_chunking"), _Knob("pass", size, True)], tag
    if role == "critic":
        return [
            _Knob("pass", "critic.model.enable_gradient_checkpointing"),
            _Knob("pass", "critic.model.enable_activation_offload"),
            _Knob("pass", _per_micro_batch(setting, "critic", *update), True),
            _Knob("held", "critic.offload_optimizer", stage=("critic.zero_stage", 1)),
        ], tag
    if role == "rollout":
        return [_Knob("pass", f"{ROLLOUT}.micro_batch_size", True)], tag
    knobs = [
        _Knob("entropy", f"{ACTOR}.entropy_from_logits_with_chunking"),
        _Knob("entropy", f"{ACTOR}.entropy_checkpointing"),
        _Knob("pass", f"{MODEL}.enable_gradient_checkpointing"),
        _Knob("pass", f"{MODEL}.enable_activation_offload"),
        _Knob("pass", _per_micro_batch(setting, ACTOR, *update), True),
        _Knob("held", f"{ACTOR}.offload_optimizer", stage=(f"{ACTOR}.zero_stage", 1)),
        _Knob("held", f"{ACTOR}.offload_param", stage=(f"{ACTOR}.zero_stage", 3)),
    ]
    return knobs, tag if role == "actor" else "the policy's update (the failing range is not an rlprof range)"


def remedies(moment: OomMoment, setting: Optional[Setting] = None) -> list[Remedy]:
    """The overrides to try for ``moment``'s failure (see the module doc), the ones acting on the most bytes first."""
    setting = setting or (lambda key: None)
    failed = moment.failure.tag
    role = role_of(failed)
    own = sum(size for tag, size in moment.by_tag.items() if tag and role_of(tag) == role)
    entropy = sum(
        s.bytes for s in moment.sites if s.tag and role_of(s.tag) == role and any(k in s.site for k in ENTROPY_SITES)
    )
    held = moment.live_bytes - own
    amounts = {"pass": own, "entropy": entropy, "held": held}
    knobs, what = _knobs(failed, setting)
    if moment.failure.exceeds_device:  # freeing makes no room: only a smaller request helps
        entropy_request = any(k in moment.failure.site for k in ENTROPY_SITES)
        knobs = [k for k in knobs if k.half or (k.kind == "entropy" and entropy_request)]
        amounts = dict.fromkeys(amounts, moment.failure.requested)
        request = "the request itself"
        words = {"pass": f"{request} (fewer rows or tokens a micro-batch)", "entropy": f"{request} (in chunks)"}
    else:
        words = {
            "pass": f"what {what} allocates (activations, logits, its backward's)",
            "entropy": "its entropy's softmax over the vocabulary",
            "held": "parameters, gradients and optimizer state held on the device",
        }
    found = []
    for knob in knobs:
        override = _override(knob, setting)
        if override is not None:
            found.append(Remedy(override, words[knob.kind], amounts[knob.kind]))
    return sorted(found, key=lambda r: -r.bytes)


def _override(knob: _Knob, setting: Setting) -> Optional[str]:
    value = setting(knob.key)
    if knob.half:
        return f"{knob.key}={value // 2}" if isinstance(value, int) and value > 1 else None
    if value is True:
        return None
    override = f"{knob.key}=true"
    if knob.stage is not None:  # offload needs a ZeRO stage: set where the run's is lower, or unknown and 3 is needed
        key, lowest = knob.stage
        stage = setting(key)
        if (stage < lowest) if isinstance(stage, int) else lowest == 3:
            override = f"{key}={lowest} {override}"
    return override
