"""The fully-async trainer's loop (verl's ``FullyAsyncTrainer``): a step is one parameter version, made of
``trigger_parameter_sync_step`` local updates, each on ``required`` prompt groups pulled from the rollout pool's
queues (:mod:`rlprof_train.rollout_stream`), then one weight sync:

    (gen: pull -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor) x trigger
    -> sync_rollout_weights -> feed

Each local update is :class:`~rlprof_train.trainer.PPOTrainer`'s step on its batch; the step's metrics aggregate
theirs as verl's ``MetricsAggregator`` does (:func:`aggregate_updates`). Staleness is ``V - v``: the version ``V``
the update starts from less the version ``v`` that sampled the trajectory
(:meth:`~rlprof.metrics.pipeline.TrainerMeter.consumed`).
"""

from __future__ import annotations

from typing import Any, Optional

from rlprof.metrics import MetricAggregator, Reduce
from rlprof.metrics.pipeline import TrajectoryRecord
from rlprof_train.batch import RolloutBatch, concat_batches
from rlprof_train.rollout_pool import part
from rlprof_train.rollout_stream import Budget, Group, StreamedRollout
from rlprof_train.trainer import PPOTrainer

LAST = ("fully_async/count/", "training/global_step", "training/epoch", "training/batch_fingerprint")
"""Metrics a step takes from its last local update (verl's ``last`` rule; the counts are running totals)."""


def aggregate_updates(updates: list[dict[str, float]], world_size: int) -> dict[str, float]:
    """A step's metrics from its local updates' (each all ranks' already), by verl's rules
    (``verl/experimental/fully_async_policy/detach_utils.py``): times (``timing_s/*``, ``perf/time_per_step``) and
    totals summed, means averaged, maxima and minima kept, running counts the last; then
    ``perf/throughput = perf/total_num_tokens / (perf/time_per_step * world_size)`` over the whole step. A metric
    only some updates have (the window's, the sync's) is aggregated over those."""
    keys = {key for update in updates for key in update}
    out: dict[str, float] = {}
    for key in sorted(keys):
        values = [update[key] for update in updates if key in update]
        name = key.lower()
        if key.startswith(LAST):
            out[key] = values[-1]
        elif name.startswith("timing_s/") or key == "perf/time_per_step":
            out[key] = sum(values)
        elif any(word in name for word in ("mean", "avg", "average")):
            out[key] = sum(values) / len(values)
        elif "max" in name:
            out[key] = max(values)
        elif "min" in name:
            out[key] = min(values)
        elif "sum" in name or "total" in name:
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    if out.get("perf/time_per_step") and "perf/total_num_tokens" in out and "perf/throughput" in out:
        out["perf/throughput"] = out["perf/total_num_tokens"] / (out["perf/time_per_step"] * world_size)
    return out


class FullyAsyncTrainer(PPOTrainer):
    """:class:`~rlprof_train.trainer.PPOTrainer` whose step is a parameter version of several local updates on
    groups streamed from the rollout pool."""

    rollout_pool = StreamedRollout

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.local = 0
        """Local updates of the current step so far."""
        self.pulled: list[Group] = []
        """Groups pulled from the rollout pool and not yet trained on (the same on every rank), oldest first."""
        super().__init__(*args, **kwargs)
        self.fed = self.rounds_used
        """Stream positions fed to the rollout pool so far."""

    @property
    def budget(self) -> Budget:
        return Budget.of(self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size, self.cfg.async_training)

    @property
    def updates_per_step(self) -> int:
        return self.cfg.async_training.trigger_parameter_sync_step

    def round_size(self) -> int:
        return 1  # the stream's positions are single prompts (verl's data.gen_batch_size=1)

    def rounds_in_run(self) -> int:
        """``rollout.total_rollout_steps`` prompts, at most the epochs'."""
        limit = self.cfg.rollout.total_rollout_steps
        return min(super().rounds_in_run(), limit) if limit is not None else super().rounds_in_run()

    def steps_in_run(self) -> int:
        """Parameter versions the run's prompts make, ``required * trigger`` a version; at most
        ``trainer.total_training_steps``."""
        versions = self.rounds_total // self.budget.per_version
        return min(self.cfg.trainer.total_training_steps or versions, versions)

    def train_step(self, step: int) -> Optional[dict[str, float]]:
        """Step ``step``: ``trigger`` local updates, the last ending with the weight sync (:meth:`after_update`)."""
        self.local = 0
        updates = []
        for _ in range(self.budget.trigger):
            metrics = super().train_step(step)
            assert metrics is not None, "the run's steps are those its prompts fill"
            updates.append(metrics)
        return aggregate_updates(updates, self.env.world_size)

    def update_index(self, step: int) -> int:
        return self.updates_before(step) * self.budget.trigger + self.local + 1

    def window_ends(self) -> bool:
        return self.local == self.budget.trigger

    def submit_round(self, step: int) -> None:
        """Feed the stream as far as the budget allows: the positions after those fed so far, up to ``consumed +
        max_required`` (the run's last at most)."""
        assert isinstance(self.pooled, StreamedRollout)
        target = min(self.rounds_total, self.rounds_used + self.budget.max_required)
        prompts = [self.prompts.batch(position)[0] for position in range(self.fed + 1, target + 1)]
        self.pooled.feed(self.fed + 1, prompts, self.sampling)
        self.fed = max(self.fed, target)

    def sample(self, timing: dict[str, float], workers: MetricAggregator) -> Optional[RolloutBatch]:
        """This rank's part of the local update's ``required`` groups, the oldest pulled first; pulled as needed
        (the trainer's wait for samples, ``timing_s/gen``), recorded, their staleness measured, scored."""
        assert isinstance(self.pooled, StreamedRollout) and self.records is not None
        required = self.budget.required
        with self._phase("gen", timing, role="rollout"), self.pipeline.waiting("samples"):
            while len(self.pulled) < required:
                self.pulled += self.pooled.pull(self.step)
        taken, self.pulled = self.pulled[:required], self.pulled[required:]
        self.rounds_used += required
        mine = part(taken, self.env.rank, self.env.world_size)
        batch = concat_batches([group.batch for group in mine]).to(self.env.device)
        self._record(mine)
        trajectories = [
            TrajectoryRecord(group.position, first, last, group.seconds)
            for group in taken
            for first, last in group.versions
        ]
        for key, value in self.pipeline.consumed(trajectories).items():
            workers.add(key, value, Reduce.LAST)  # every rank measured all the update's groups
        workers.add("timing_s/generate_async", max(group.seconds for group in taken), Reduce.MAX)
        self.score(batch, [self.prompts.batch(group.position)[0] for group in mine], timing, workers)
        return batch

    def _record(self, groups: list[Group]) -> None:
        """Each trajectory of this rank's ``groups``, as it is consumed."""
        assert self.records is not None
        consumed = self.pipeline.version
        self.records.write_all(
            {
                "event": "sample",
                "step": self.step,
                "uid": group.position,
                "version": last,
                "first_version": first,
                "consumed_version": consumed,
                "rollout_rank": group.rank,
                "response_tokens": int(tokens),
            }
            for group in groups
            for (first, last), tokens in zip(group.versions, group.batch.response_mask.sum(dim=1).tolist(), strict=True)
        )

    def after_update(self, step: int, timing: dict[str, float], workers: MetricAggregator) -> None:
        """After the step's last local update: the weights to the rollout pool (version ``updates_before(step +
        1)``), its window's metrics, the groups its processes hold (pulled now: between two samplings, as they just
        took the weights, they hand them over at once, where a pull during a sampling waits for it), and the stream
        fed for the next version."""
        self.local += 1
        if self.local < self.budget.trigger:
            return
        assert isinstance(self.pooled, StreamedRollout)
        version = self.updates_before(step + 1)  # none during trainer.critic_warmup
        with self._phase("sync_rollout_weights", timing, role="rollout"):
            window = self.pooled.publish_weights(version)
        self.pipeline.version = version  # the next update's weights
        for key, value in window.items():  # the rollout pool's time since the last sync, ended by this one
            workers.add(key, value, Reduce.LAST)
        if step == self.total_steps:
            return  # nothing more to take or feed
        with self._phase("gen", timing, role="rollout"), self.pipeline.waiting("samples"):  # what the rollout
            self.pulled += self.pooled.pull(step + 1)  # processes hold, taken while they are between samplings
        self.submit_round(step + 1)
