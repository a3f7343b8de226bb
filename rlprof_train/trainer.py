"""The PPO loop, one step at a time:

    gen (-> gen_max) -> reward (-> gen_refill -> reward ...) -> old_log_prob -> ref -> values -> adv
    -> update_critic -> update_actor (-> update_weights)

(``gen_max``: ReMax's greedy baseline response per prompt; ``gen_refill``: the generation rounds after the first,
while DAPO's dynamic sampling or ``data.gen_batch_size`` leaves the step short of prompt groups
(:mod:`rlprof_train.dynamic_sampling`); ``update_actor`` waits for ``trainer.critic_warmup``.)

Every phase runs under ``marked_timer`` (its time into ``timing_s/*`` and an rlprof range of its role), each step
under ``rlprof.step``. Ranks are data-parallel: each takes its share of the step's prompts; DeepSpeed averages the
gradients; metrics are reduced across ranks (:mod:`rlprof_train.step_reduction`) and logged by rank 0. What a run
prepares before its first step is in :mod:`rlprof_train.prepare`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

import rlprof
from rlprof.live_gpu_idle import WindowGpuIdle
from rlprof.metrics import MetricAggregator, Reduce
from rlprof.metrics.pipeline import TrainerMeter
from rlprof.metrics.pipeline_records import PipelineLog
from rlprof.watchdog import Watchdog
from rlprof_train import algos, checkpoint, prepare, rollout_correction
from rlprof_train.batch import MicroBatching, RolloutBatch
from rlprof_train.config import TrainerConfig, as_dict
from rlprof_train.config.schema import ValKwargs
from rlprof_train.data import Example, PromptBatches, load_datasets, shard
from rlprof_train.dynamic_sampling import GenerationLimit, Rounds, assemble
from rlprof_train.lr_schedule import LRSchedule
from rlprof_train.models import load_tokenizer
from rlprof_train.pools import Link
from rlprof_train.progress import Progress
from rlprof_train.rollout_pool import PooledRollout
from rlprof_train.step_reduction import StepFacts, step_metrics
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.reward_worker import Scores
from rlprof_train.workers.rollout import Rollout, SamplingParams
from rlprof_train.workers.rollout.base import noise_key


class PPOTrainer:
    rollout_pool: type[PooledRollout] = PooledRollout
    """The trainer's side of its rollout pool, when it has one (the one-step-off trainer's)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        env: DistEnv,
        run_id: str,
        log: Callable[[str], None] = print,
        progress: Optional[Progress] = None,
        link: Optional[Link] = None,
        per_node: Optional[int] = None,
    ) -> None:
        """``link``: the one-step-off trainer's link to its rollout pool (:mod:`rlprof_train.pools`); None: the
        rollout runs in these processes. ``per_node``: the launch's processes on a node, as the launcher started them
        (both pools'; recorded in ``run.json``); None: the trainer's world, one node."""
        self.cfg, self.env, self.log = cfg, env, log
        self.progress = progress or Progress(env.rank, env.world_size, cfg.trainer.collective_timeout_s)
        self.step = 0
        arr, algorithm, trainer = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
        self.run_directory = prepare.open_run_directory(cfg, env, log)
        model_path = prepare.prepare_model(cfg, env, log)
        self.tokenizer = load_tokenizer(model_path)
        tools = prepare.rollout_tools(cfg)
        train, self.val_examples, notes = load_datasets(
            cfg.data, self.tokenizer, trainer.seed, [tool.tool_schema for tool in tools] or None
        )
        round_size = self.round_size()
        setting = "data.gen_batch_size" if cfg.data.gen_batch_size else "data.train_batch_size"
        self.prompts = PromptBatches(train, round_size, trainer.seed, cfg.data.shuffle, setting)
        self.rounds_used = 0
        """Batches of the prompt stream generated so far (a step takes one or more: generation rounds)."""
        self.rounds_total = self.rounds_in_run()
        self.total_steps = self.steps_in_run()
        self.actor_lr = LRSchedule(arr.actor.optim, self.total_steps * self.updates_per_step)
        self.critic_lr = LRSchedule(cfg.critic.optim, self.total_steps * self.updates_per_step)
        self.sampling = SamplingParams(
            arr.rollout.n,
            arr.rollout.temperature,
            arr.rollout.top_p,
            arr.rollout.top_k,
            arr.rollout.response_length,
            trainer.seed,
        )
        self.log_prob_batching = MicroBatching(
            arr.rollout.log_prob_micro_batch_size_per_gpu,
            arr.rollout.log_prob_use_dynamic_bsz,
            arr.rollout.log_prob_max_token_len_per_gpu,
            arr.model.use_remove_padding,
        )

        self.estimator = algos.adv_estimator(algorithm.adv_estimator)
        self.correction = prepare.correction(cfg)
        resumed_from = prepare.resume_point(cfg, env, log)
        self.actor = prepare.make_actor(cfg, env, model_path, resumed_from, log, self.correction)
        self.reward = prepare.make_reward(cfg, env, self.tokenizer, log)
        self.ref = prepare.make_ref(cfg, env, model_path, self.actor)
        self.critic = prepare.make_critic(cfg, env, model_path, resumed_from, self.estimator)
        prepare.note_zero_stages(cfg, self.actor, self.critic, log)
        self.pooled: Optional[PooledRollout] = None
        """The one-step-off trainer's rollout pool: the next step's batch generates there while this one trains."""
        self.records: Optional[PipelineLog] = None
        """The one-step-off trainer's pipeline records (:mod:`rlprof.metrics.pipeline_records`)."""
        if link is None:
            self.rollout: Rollout = prepare.make_rollout(
                cfg, env, model_path, self.actor, self.tokenizer, log, tools, wants_log_probs=self.correction.active
            )
        else:
            self.pooled = self.rollout_pool(link, env, lambda: self.actor.module, arr.actor.zero_stage)
            self.rollout = self.pooled
            self.pooled.start(model_path, run_id, self.correction.active, resumed_from is not None)
        self.reuse_log_probs = prepare.reuses_on_policy_log_probs(cfg, log)
        self.kl_ctrl = algos.KLController(
            algorithm.kl_ctrl.kl_coef, algorithm.kl_ctrl.type, algorithm.kl_ctrl.target_kl, algorithm.kl_ctrl.horizon
        )
        self.guard = prepare.nonfinite_guard(cfg, self.critic is not None)

        self.start_step = self.resume(resumed_from) if resumed_from else 1
        rollout_processes = link.pool.rollout_size if link is not None else 0
        prepare.record_run(
            cfg,
            env,
            run_id,
            self.start_step,
            self.total_steps,
            resumed_from,
            rollout_processes,
            per_node if per_node is not None else env.world_size,
        )
        self.tracker = prepare.make_tracker(cfg, env, self.total_steps, self.start_step if resumed_from else None)
        prepare.write_rollout_scrape_config(cfg, env, log)
        for note in notes:
            self.log(note)

    @property
    def updates_per_step(self) -> int:
        """Policy updates a step makes (the fully-async trainer: several, one weight sync)."""
        return 1

    def round_size(self) -> int:
        """Prompts per batch of the prompt stream (a generation round)."""
        return self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size

    def rounds_in_run(self) -> int:
        """Batches of the prompt stream the run may generate: ``trainer.total_epochs`` of them."""
        return self.cfg.trainer.total_epochs * self.prompts.batches_per_epoch

    def steps_in_run(self) -> int:
        """``trainer.total_training_steps``, at most what the epochs' prompts fill (``rounds_total``)."""
        rounds_per_step = math.ceil(self.cfg.data.train_batch_size / self.prompts.batch_size)
        epoch_steps = self.rounds_total // rounds_per_step  # at most, filtering
        return min(self.cfg.trainer.total_training_steps or epoch_steps, epoch_steps)

    # ----------------------------------------------------------------------------------------- the loop

    def fit(self) -> None:
        """Train from ``start_step`` to ``total_steps``, validating and checkpointing on schedule."""
        trainer = self.cfg.trainer
        self.watchdog = Watchdog(
            trainer.watchdog,
            Path(trainer.log_dir),
            self.env.rank,
            self.env.world_size,
            self.progress.store,
            positions=self.progress.positions,
            setting="trainer.watchdog",
        )
        self.gpu_idle: Optional[WindowGpuIdle] = None
        session = rlprof.get_session()
        if self.tracker is not None:
            self.tracker.add_live(self.watchdog.live_samples)  # each rank's phase, read at each scrape
            if session is not None:  # and the GPU's idle share in each torch window's trace
                self.gpu_idle = WindowGpuIdle.follow(session, self.tracker)
        try:
            compile_metrics = self.warm_up()
            if self.pooled is not None:  # the weights the first batches are sampled with
                self.pooled.publish_weights(self.updates_before(self.start_step))
            if trainer.val_before_train and self.start_step == 1:
                self._log({**self.validate(0), "training/global_step": 0.0}, step=0)
            if self.pooled is not None:
                self.submit_round(self.start_step)
                self.records = PipelineLog(trainer.log_dir, self.env.rank, "trainer", self.start_step > 1)
                self.pipeline = TrainerMeter(record=self.records.write)  # its waits for samples, each step from here
                self.pipeline.version = self.updates_before(self.start_step)
            for step in range(self.start_step, self.total_steps + 1):
                torch.manual_seed(trainer.seed * 100_003 + step * self.env.world_size + self.env.rank)
                with rlprof.step(step):
                    metrics = self.train_step(step)
                if metrics is None:
                    self.log(
                        f"the prompts of trainer.total_epochs={trainer.total_epochs} are used up: step {step} could "
                        f"not fill its batch ({self.rounds_used} generation rounds in all); the run ends at step "
                        f"{step - 1}"
                    )
                    break
                metrics.update(compile_metrics)
                compile_metrics = {}
                if step in self.watchdog.stalled_steps:
                    metrics["watchdog/stalls"] = 1.0
                last = step == self.total_steps
                if trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
                    self.progress.at(step, "validate")
                    metrics.update(self.validate(step))
                self.progress.at(step, "log")
                self._log(metrics, step)
                self.guard.check(metrics, step)
                if trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last) and self.guard.healthy:
                    self.progress.at(step, "save")
                    self.save(step)
        except BaseException:
            if self.pooled is not None:  # the other ranks may be anywhere: no collective with them to close
                self.pooled.abandon()
            raise
        finally:
            self.watchdog.close()
            if self.gpu_idle is not None:
                self.gpu_idle.close()
            self.close()

    @contextlib.contextmanager
    def _phase(self, name: str, timing: dict[str, float], role: str) -> Iterator[None]:
        """``rlprof.marked_timer`` of the phase, its start published for a stall report (:mod:`.progress`) and
        watched (:mod:`.watchdog`)."""
        self.progress.at(self.step, name, role)
        with self.watchdog.phase(self.step, name), rlprof.marked_timer(name, timing, role=role):
            yield

    def train_step(self, step: int) -> Optional[dict[str, float]]:
        """One PPO step on this rank's share of the step's prompts; returns the step's metrics (all ranks agree), or
        None when the prompt stream ran out before the step's batch was full (nothing trained)."""
        self.step = step
        timing: dict[str, float] = {}
        workers = MetricAggregator()
        with self._phase("step", timing, role="trainer"):
            sampled = self.sample(timing, workers)
            if sampled is None:
                return None
            batch = sampled
            if self.correction.bypass:  # verl's bypass mode: the rollout's log-probs are the old ones
                batch.old_log_probs = batch.extras["rollout_log_probs"]
            elif not self.reuse_log_probs:  # else the update's own forward gives them (on-policy)
                with self._phase("old_log_prob", timing, role="actor"):
                    batch.old_log_probs, actor_metrics = self.actor.compute_log_prob(batch, self.log_prob_batching)
                    workers.merge(actor_metrics)
            if "rollout_log_probs" in batch.extras and not self.correction.bypass and batch.old_log_probs is not None:
                gap = (batch.old_log_probs - batch.extras["rollout_log_probs"]).abs()  # how off-policy samples are
                workers.add(
                    "rollout/log_prob_abs_diff",
                    algos.masked_mean(gap, batch.response_mask).item(),
                    Reduce.WEIGHTED_MEAN,
                    float(batch.response_mask.sum()),
                )
            if self.ref is not None:
                with self._phase("ref", timing, role="ref"):
                    batch.ref_log_probs, ref_metrics = self.ref.compute_ref_log_prob(batch)
                    workers.merge(ref_metrics)
            if self.critic is not None:
                with self._phase("values", timing, role="critic"):
                    batch.values = self.critic.compute_values(batch)
            with self._phase("adv", timing, role="trainer"):
                workers.merge(self.compute_advantages(batch))
            if self.critic is not None:
                with self._phase("update_critic", timing, role="critic"):
                    workers.merge(self.critic.update(batch, self.critic_lr.lr(step)))
            if step >= self.cfg.trainer.critic_warmup:  # before it, only the critic trains (verl's critic_warmup)
                with self._phase("update_actor", timing, role="actor"):
                    workers.merge(self.actor.update(batch, self.actor_lr.lr(self.update_index(step))))
                if self.pooled is None:  # one-step-off: at the next step, once its batch is in
                    with self._phase("update_weights", timing, role="rollout"):
                        self.rollout.sync_weights()
            self.after_update(step, timing, workers)
        if self.pooled is not None and self.window_ends():
            for key, value in self.pipeline.step_done(step).items():
                workers.add(key, value, Reduce.MEAN)
        return step_metrics(self.env, self._facts(step), batch, timing, workers)

    def update_index(self, step: int) -> int:
        """The learning-rate schedule's place for the update of step ``step`` (from 1)."""
        return self.updates_before(step) + 1

    def after_update(self, step: int, timing: dict[str, float], workers: MetricAggregator) -> None:
        """After a step's updates, inside its ``step`` phase (the fully-async trainer's weight sync)."""

    def window_ends(self) -> bool:
        """Whether the pipeline's trainer window (its waits, its idle ratio) ends with this update."""
        return True

    def sample(self, timing: dict[str, float], workers: MetricAggregator) -> Optional[RolloutBatch]:
        """This rank's share of the step's ``train_batch_size`` prompt groups, generated and scored: one round of
        the prompt stream, or several (``gen_refill``) while DAPO's dynamic sampling drops groups without variance
        or ``data.gen_batch_size`` is smaller than the step (:mod:`rlprof_train.dynamic_sampling`). None when the
        stream runs out first."""
        data, filtering = self.cfg.data, self.cfg.algorithm.filter_groups
        rounds = Rounds()
        while rounds.groups < data.train_batch_size:
            if self.rounds_used == self.rounds_total:
                return None
            limit = filtering.max_num_gen_batches
            if filtering.enable and 0 < limit <= len(rounds.kept):
                raise GenerationLimit(
                    f"algorithm.filter_groups.max_num_gen_batches={limit}: {limit} generation rounds kept "
                    f"{rounds.groups} of the {data.train_batch_size} prompt groups the step needs ({rounds.dropped} "
                    f"had no variance in {filtering.metric}); allow more rounds (0: no limit) or use data whose "
                    "prompts the policy neither always solves nor always fails"
                )
            self.rounds_used += 1
            round_prompts = self.prompts.batch(self.rounds_used)
            prompts = shard(round_prompts, self.env.rank, self.env.world_size)
            if rounds.kept:  # a later round's prompt may be an earlier round's (a new epoch): its own groups
                offset = len(rounds.kept) * len(self.prompts.examples)
                prompts = [dataclasses.replace(p, index=p.index + offset) for p in prompts]
            with self._phase("gen_refill" if rounds.kept else "gen", timing, role="rollout"):
                sampling = self.round_sampling(self.rounds_used)
                batch = self.generate(prompts, sampling) if self.pooled is None else self.collect(workers)
            if self.pooled is not None:  # one-step-off: the next batch is sampled while this one trains
                with self._phase("sync_rollout_weights", timing, role="rollout"):
                    window = self.pooled.publish_weights(self.updates_before(self.step))
                for key, value in window.items():  # the rollout pool's time since the last sync, ended by this one
                    workers.add(key, value, Reduce.LAST)
                self.submit_round(self.step + 1)
            scores = self.score(batch, prompts, timing, workers)
            rounds.keep(batch, filtering, scores.per_response, self.env.gather, len(round_prompts))
        if len(rounds.kept) == 1 and not filtering.enable:
            return rounds.kept[0].batch  # the usual step: one round, all of it
        batch, surplus = assemble(rounds, data.train_batch_size, self.env.rank, self.env.world_size, self.env.gather)
        workers.add("train/num_gen_batches", float(len(rounds.kept)), Reduce.LAST)
        if filtering.enable:
            workers.add("training/filter_groups/evicted_samples", float(rounds.dropped), Reduce.LAST)
            for value, count in sorted(rounds.dropped_by_value.items()):
                workers.add(f"training/filter_groups/filtered_reward_counts/{value:g}", float(count), Reduce.LAST)
        workers.add("training/filter_groups/discarded_surplus_samples", float(surplus), Reduce.LAST)
        generated = rounds.groups + rounds.dropped
        dropped = (
            f"; {rounds.dropped} of {generated} had no variance in {filtering.metric} ("
            + ", ".join(f"all {value:g}: {count}" for value, count in sorted(rounds.dropped_by_value.items()))
            + ")"
            if filtering.enable
            else ""
        )
        self.log(
            f"step {self.step}: {len(rounds.kept)} generation rounds for {data.train_batch_size} prompt groups"
            f"{dropped}; {surplus} kept beyond them dropped"
        )
        return batch

    def score(
        self, batch: RolloutBatch, prompts: list[Example], timing: dict[str, float], workers: MetricAggregator
    ) -> Scores:
        """``batch``'s rewards (``token_level_scores``), after ReMax's greedy baselines of its ``prompts`` when the
        estimator needs them."""
        if self.estimator.needs_baseline:
            with self._phase("gen_max", timing, role="rollout"):
                batch.extras["reward_baselines"] = self.greedy_baselines(prompts)
        with self._phase("reward", timing, role="reward"):
            scores = self.reward.score(batch)
            batch.token_level_scores = scores.token_level
            workers.merge(scores.metrics)
        return scores

    def submit_round(self, step: int) -> None:
        """One-step-off: step ``step``'s prompts to the rollout pool (none after the last step, or once the prompt
        stream is used up: one generation round a step), sampled beside step ``step - 1``."""
        assert self.pooled is not None
        if step <= self.total_steps and step <= self.rounds_total:
            prompts = shard(self.prompts.batch(step), self.env.rank, self.env.world_size)
            self.pooled.submit(prompts, self.round_sampling(step), step, step - 1 if step > self.start_step else None)

    def collect(self, workers: MetricAggregator) -> RolloutBatch:
        """One-step-off: this step's batch from the rollout pool, with what the pool measured: its sampling time
        (``timing_s/generate_async``, beside the step) and each trajectory's staleness ``V - v``, the policy's updates
        ``V`` before this step less those ``v`` before the weights that sampled it (verl's
        ``training/off_policy/trajectory_staleness/*``), each trajectory recorded."""
        assert self.pooled is not None and self.records is not None
        with self.pipeline.waiting("samples"):
            collected = self.pooled.collect()
        workers.add("timing_s/generate_async", collected.seconds, Reduce.MAX)
        consumed = self.updates_before(self.step)
        batch = collected.batch
        tokens = batch.response_mask.sum(dim=1).tolist()
        self.records.write_all(
            {
                "event": "sample",
                "step": self.step,
                "uid": batch.uid[row],
                "version": version,
                "consumed_version": consumed,
                "rollout_rank": rollout_rank,
                "response_tokens": int(tokens[row]),
            }
            for row, (version, rollout_rank) in enumerate(zip(collected.versions, collected.rollout_ranks, strict=True))
        )
        staleness = [float(consumed - version) for version in collected.versions]
        prefix = "training/off_policy/trajectory_staleness"
        workers.add(f"{prefix}/mean", sum(staleness) / len(staleness), Reduce.WEIGHTED_MEAN, len(staleness))
        workers.add(f"{prefix}/max", max(staleness), Reduce.MAX)
        workers.add(f"{prefix}/min", min(staleness), Reduce.MIN)
        return batch

    def updates_before(self, step: int) -> int:
        """The policy's updates before step ``step`` (none before ``trainer.critic_warmup``): its weights' version."""
        warmup = max(self.cfg.trainer.critic_warmup, 1)
        return max(0, step - warmup)

    def compute_advantages(self, batch: RolloutBatch) -> MetricAggregator:
        """Token rewards (scores, minus the KL penalty when ``use_kl_in_reward``), the rollout correction (decoupled
        mode: importance weights and the rejection's narrower response mask), then advantages and returns."""
        algorithm, metrics = self.cfg.algorithm, MetricAggregator()
        assert batch.token_level_scores is not None, "run the earlier phases first"
        if algorithm.use_kl_in_reward:
            assert batch.ref_log_probs is not None, "use_kl_in_reward needs the reference's log-probs"
            assert batch.old_log_probs is not None, "use_kl_in_reward needs the old log-probs"
            batch.token_level_rewards, current_kl = algos.apply_kl_in_reward(
                batch.token_level_scores,
                batch.old_log_probs,
                batch.ref_log_probs,
                batch.response_mask,
                self.kl_ctrl.coef,
                algorithm.kl_penalty,
            )
            metrics.add("actor/reward_kl_penalty", current_kl.item(), Reduce.MEAN)
            metrics.add("actor/reward_kl_penalty_coeff", self.kl_ctrl.coef, Reduce.LAST)
            self.kl_ctrl.update(current_kl.item(), n_steps=batch.size * self.env.world_size)
        else:
            batch.token_level_rewards = batch.token_level_scores
        assert batch.token_level_rewards is not None
        if self.correction.active and not self.correction.bypass:  # verl's decoupled mode, once per step
            assert batch.old_log_probs is not None, "the rollout correction needs the old log-probs"
            batch.rollout_is_weights, batch.response_mask, corrected = rollout_correction.correct(
                batch.old_log_probs,
                batch.extras["rollout_log_probs"],
                batch.response_mask,
                self.correction,
                self.env.sum,
            )
            metrics.merge(corrected)
        batch.advantages, batch.returns = algos.compute_advantage(
            algorithm.adv_estimator,
            batch.token_level_rewards,
            batch.response_mask,
            values=batch.values,
            index=batch.uid,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
            reward_baselines=batch.extras.get("reward_baselines"),
            total=self.env.sum,
        )
        return metrics

    def warm_up(self) -> dict[str, float]:
        """The rollout's compile for the first step's prompts, timed on its own (``timing_s/rollout_compile``, logged
        with that step) so that no step's time includes it; empty when the rollout compiles nothing."""
        prompts = shard(self.prompts.batch(self.rounds_used + 1), self.env.rank, self.env.world_size)
        timing: dict[str, float] = {}
        with rlprof.marked_timer("rollout_compile", timing, role="rollout"):
            compiled = self.rollout.warm_up(prompts, self.round_sampling(self.rounds_used + 1))
        return {"timing_s/rollout_compile": timing["rollout_compile"]} if compiled else {}

    def round_sampling(self, k: int) -> SamplingParams:
        """How generation round ``k`` (batch ``k`` of the prompt stream) samples: its own seed, so its prompts get
        the same responses whichever rank, process or pool samples them."""
        return dataclasses.replace(self.sampling, seed=noise_key(self.cfg.trainer.seed, k))

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        """The rollout's batch for ``prompts``, on this rank's device: where the step's data crosses to the models,
        once (every later phase computes where its inputs are)."""
        return self.rollout.generate(prompts, sampling).to(self.env.device)

    def greedy_baselines(self, prompts: list[Example]) -> torch.Tensor:
        """ReMax's baseline: the score of one greedy response per prompt, for each of its n rows ``[P * n]``."""
        greedy = SamplingParams(1, 0.0, 1.0, -1, self.sampling.response_length)
        baseline = self.generate(prompts, greedy)
        scores = self.reward.score(baseline).token_level.sum(-1)
        return scores.repeat_interleave(self.sampling.n)

    def validate(self, step: int) -> dict[str, float]:
        """Mean reward per data source on the validation prompts, sampled as ``val_kwargs`` says (greedy unless
        ``do_sample``, as verl); ``trainer.log_val_generations`` of the samples to ``val_generations.jsonl``."""
        if not self.val_examples:
            return {}
        val_kwargs = self.cfg.actor_rollout_ref.rollout.val_kwargs
        sampling = validation_sampling(val_kwargs, self.sampling.response_length, self.cfg.trainer.seed, step)
        prompts = self.val_examples[self.env.rank :: self.env.world_size]
        per_call = max(1, (self.cfg.data.val_batch_size or len(self.val_examples)) // self.env.world_size)
        samples = []
        logged = self.cfg.trainer.log_val_generations
        chunks = [prompts[start : start + per_call] for start in range(0, len(prompts), per_call)]
        if self.pooled is not None:  # each call is a collective of the trainer pool: as many on every rank
            chunks += [[]] * (max(self.env.gather(len(chunks))) - len(chunks))
        for chunk in chunks:
            batch = self.generate(chunk, sampling)
            if batch.size == 0:
                continue
            scores = self.reward.score(batch).token_level.sum(-1).tolist()
            texts = self.decode_samples(batch) if logged else [("", "")] * batch.size
            samples += [(s, score, *text) for s, score, text in zip(batch.data_source, scores, texts, strict=True)]
        results = [sample for r in self.env.gather(samples) for sample in r]
        per_source: dict[str, list[float]] = {}
        for source, score, _, _ in results:
            per_source.setdefault(source, []).append(score)
        if logged and self.env.is_main:
            self.log_val_generations([(prompt, response, score) for _, score, prompt, response in results], step)
        return {f"val-core/{source}/reward/mean@{val_kwargs.n}": sum(v) / len(v) for source, v in per_source.items()}

    def decode_samples(self, batch: RolloutBatch) -> list[tuple[str, str]]:
        """(prompt, response) texts of each row, special tokens dropped."""
        prompts = self.tokenizer.batch_decode(
            batch.input_ids[:, : batch.prompt_length].tolist(), skip_special_tokens=True
        )
        return list(zip(prompts, self.reward.decode(batch), strict=True))

    def log_val_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """``trainer.log_val_generations`` of the validation's (prompt, response, score) samples, chosen as verl
        chooses them (sorted by prompt, shuffled with seed 42, the first N), as one line of
        ``{trainer.log_dir}/val_generations.jsonl``."""
        chosen = sorted(samples, key=lambda sample: sample[0])
        random.Random(42).shuffle(chosen)
        line = {
            "step": step,
            "samples": [
                {"input": p, "output": r, "score": score}
                for p, r, score in chosen[: self.cfg.trainer.log_val_generations]
            ],
        }
        path = Path(self.cfg.trainer.log_dir) / "val_generations.jsonl"
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    # ----------------------------------------------------------------------------------------- glue

    def _facts(self, step: int) -> StepFacts:
        return StepFacts(
            step,
            self.prompts.epoch_of(self.rounds_used) + 1,
            self.sampling.response_length,
            self.cfg.data.max_prompt_length,
            self.actor.module.config,
            self.cfg.actor_rollout_ref.actor.ppo_epochs,
        )

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    def _engines(self) -> dict[str, Any]:
        return {"actor": self.actor.engine, **({"critic": self.critic.engine} if self.critic is not None else {})}

    def resume(self, path: Path) -> int:
        state = checkpoint.load(path, self._engines())
        changed = set(checkpoint.changed_settings(path, as_dict(self.cfg)))  # allowed ones only (checked at start)
        if not changed & {"algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type"}:
            self.kl_ctrl.coef = state["kl_coef"]  # the adaptive controller's state; a changed setting starts anew
        for role, optim in (("actor", self.cfg.actor_rollout_ref.actor.optim), ("critic", self.cfg.critic.optim)):
            prefix = "actor_rollout_ref.actor.optim." if role == "actor" else "critic.optim."
            engine = self._engines().get(role)
            if engine is not None and any(key.startswith(prefix) for key in changed):
                for group in engine.optimizer.param_groups:  # the loaded state holds the checkpoint's values
                    group.update(lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        if self.pooled is None:  # a rollout pool gets them as the run starts (fit)
            self.rollout.sync_weights()
        next_step = int(state["global_step"]) + 1
        rounds_per_step = math.ceil(self.cfg.data.train_batch_size / self.prompts.batch_size)
        self.rounds_used = int(state.get("prompt_batches", (next_step - 1) * rounds_per_step))
        self.log(f"checkpoint: resumed from {path} (next step {next_step})")
        return next_step

    def save(self, step: int) -> None:
        target = checkpoint.save(
            Path(self.cfg.trainer.default_local_dir),
            step,
            self._engines(),
            {"kl_coef": self.kl_ctrl.coef, "prompt_batches": self.rounds_used},
            self.env.is_main,
            self.env.barrier,
            self.cfg.trainer.max_actor_ckpt_to_keep,
            as_dict(self.cfg),
        )
        self.log(f"checkpoint: saved {target}")

    def close(self) -> None:
        self.rollout.close()
        if self.records is not None:
            self.records.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        self.run_directory.release()


VALIDATION_SEED = 0x56414C
"""Mixed into validation's seeds, so that they differ from every training round's."""


def validation_sampling(val_kwargs: ValKwargs, response_length: int, seed: int, step: int) -> SamplingParams:
    """Validation's sampling as verl's rollout sets it: ``val_kwargs.n`` responses per prompt, greedy unless
    ``do_sample`` (then its temperature, top-p and top-k), seeded by the run's ``seed`` and the ``step`` it follows."""
    if not val_kwargs.do_sample:
        return SamplingParams(val_kwargs.n, 0.0, 1.0, -1, response_length)
    return SamplingParams(
        val_kwargs.n,
        val_kwargs.temperature,
        val_kwargs.top_p,
        val_kwargs.top_k,
        response_length,
        noise_key(seed, VALIDATION_SEED, step),
    )
