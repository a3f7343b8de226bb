"""The PPO loop, one step at a time:

    gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor (-> update_weights)

Every phase runs under ``marked_timer`` (its time into ``timing_s/*`` and an rlprof range of its role), each step
under ``rlprof.step``. Ranks are data-parallel: each takes its share of the step's prompts; DeepSpeed averages the
gradients; metrics are reduced across ranks and logged by rank 0.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import rlprof
from rlprof.metrics import (compute_data_metrics, compute_memory_metrics, compute_throughput_metrics,
                            compute_timing_metrics, mfu_metrics, reduce_timing_across_ranks)
from rlprof.timer import marked_timer
from rlprof.tracking import Tracker
from rlprof_train import algos, checkpoint
from rlprof_train.batch import RolloutBatch
from rlprof_train.data import StepBatches, load_datasets, shard
from rlprof_train.models import ensure_tiny_model, load_tokenizer
from rlprof_train.reward import reward_function
from rlprof_train.workers.actor import ActorWorker
from rlprof_train.workers.critic import CriticWorker
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.ref import RefWorker
from rlprof_train.workers.reward import RewardWorker
from rlprof_train.workers.rollout import Rollout, SamplingParams
from rlprof_train.workers.rollout.base import ignored_knobs_note

EMBEDDED_MODEL_DIR = Path("outputs/models")


class PPOTrainer:
    def __init__(self, cfg: DictConfig, env: DistEnv, log: Any = print) -> None:
        self.cfg, self.env, self.log = cfg, env, log
        algorithm, rollout_cfg = cfg.algorithm, cfg.actor_rollout_ref.rollout
        self.model_path = self._model_path()
        self.tokenizer = load_tokenizer(self.model_path)

        train, self.val_examples, notes = load_datasets(cfg.data, self.tokenizer, cfg.trainer.seed)
        self.batches = StepBatches(train, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        epochs_steps = cfg.trainer.total_epochs * self.batches.steps_per_epoch
        self.total_steps = min(cfg.trainer.total_training_steps or epochs_steps, epochs_steps)
        self.sampling = SamplingParams(rollout_cfg.n, rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k,
                                       rollout_cfg.response_length)

        self.reward = RewardWorker(reward_function(cfg.custom_reward_function.path, cfg.custom_reward_function.name),
                                   self.tokenizer)
        self.actor = ActorWorker(cfg.actor_rollout_ref, self.model_path, env)
        needs_ref = cfg.actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward
        self.ref = RefWorker(cfg.actor_rollout_ref, self.model_path) if needs_ref else None
        needs_critic = cfg.critic.enable if cfg.critic.enable is not None else \
            algorithm.adv_estimator in {n for n, e in algos.ADV_ESTIMATORS.items() if e.needs_critic}
        critic_path = cfg.critic.model.path or self.model_path
        self.critic = CriticWorker(cfg, critic_path, env) if needs_critic else None
        self.rollout = self._rollout()
        self.kl_ctrl = algos.KLController(algorithm.kl_ctrl.kl_coef, algorithm.kl_ctrl.type,
                                          algorithm.kl_ctrl.target_kl, algorithm.kl_ctrl.horizon)

        if cfg.actor_rollout_ref.model.enable_activation_offload and not torch.cuda.is_available():
            notes.append("model: enable_activation_offload keeps activations on the host, where they already are "
                         "without CUDA: nothing to do")
        self.start_step = self._resume()
        self.tracker = self._tracker() if env.is_main else None
        for note in notes:
            self.log(note)

    # ----------------------------------------------------------------------------------------- setup

    def _model_path(self) -> str:
        path = self.cfg.actor_rollout_ref.model.path
        if path is not None:
            return str(path)
        if self.env.is_main:
            built = ensure_tiny_model(EMBEDDED_MODEL_DIR, self.cfg.data.task_max_operand)
            self.log(f"model: using the embedded tiny model at {built} (actor_rollout_ref.model.path=null)")
        _barrier(self.env)
        return str(EMBEDDED_MODEL_DIR / f"tiny-arithmetic-op{self.cfg.data.task_max_operand}")

    def _rollout(self) -> Rollout:
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        if rollout_cfg.name == "vllm":
            from rlprof_train.workers.rollout.vllm import VLLMRollout

            return VLLMRollout(self.cfg, self.model_path, self.actor, self.tokenizer)
        from rlprof_train.workers.rollout.hf import VLLM_ONLY_KNOBS, HFRollout

        if self.env.is_main:
            self.log(ignored_knobs_note(rollout_cfg, "hf", VLLM_ONLY_KNOBS))
        return HFRollout(lambda: self.actor.module, self.tokenizer, self.cfg.actor_rollout_ref.actor.zero_stage,
                         rollout_cfg.log_prob_micro_batch_size_per_gpu)

    def _engines(self) -> dict[str, Any]:
        engines = {"actor": self.actor.engine}
        if self.critic is not None:
            engines["critic"] = self.critic.engine
        return engines

    def _resume(self) -> int:
        path = checkpoint.find_resume_dir(Path(self.cfg.trainer.default_local_dir), self.cfg.trainer.resume_mode)
        if path is None:
            return 1
        state = checkpoint.load(path, self._engines())
        self.kl_ctrl.coef = state["kl_coef"]
        self.rollout.sync_weights()
        self.log(f"checkpoint: resumed from {path} (next step {state['global_step'] + 1})")
        return state["global_step"] + 1

    def _tracker(self) -> Tracker:
        trainer = self.cfg.trainer
        return Tracker(trainer.project_name, trainer.experiment_name, trainer.logger, log_dir=trainer.log_dir,
                       config=OmegaConf.to_container(self.cfg, resolve=True), total_steps=self.total_steps,
                       total_epochs=trainer.total_epochs, resume_step=self.start_step if self.start_step > 1 else None,
                       table_every=trainer.table_every)

    # ----------------------------------------------------------------------------------------- the loop

    def fit(self) -> None:
        """Train from ``start_step`` to ``total_steps``, validating and checkpointing on schedule."""
        trainer = self.cfg.trainer
        if trainer.val_before_train and self.start_step == 1:
            self._log({**self.validate(), "training/global_step": 0.0}, step=0)
        for step in range(self.start_step, self.total_steps + 1):
            torch.manual_seed(trainer.seed * 100_003 + step * self.env.world_size + self.env.rank)
            with rlprof.step(step):
                metrics = self.train_step(step)
            last = step == self.total_steps
            if trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
                metrics.update(self.validate())
            self._log(metrics, step)
            if trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last):
                self.save(step)
        self.close()

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step on this rank's share of the step's prompts; returns the step's metrics (all ranks agree)."""
        timing: dict[str, float] = {}
        worker_metrics: dict[str, float] = {}
        with marked_timer("step", timing, role="trainer"):
            prompts = shard(self.batches.batch(step), self.env.rank, self.env.world_size)
            with marked_timer("gen", timing, role="rollout"):
                batch = self.rollout.generate(prompts, self.sampling)
            with marked_timer("reward", timing, role="reward"):
                batch.token_level_scores = self.reward.score(batch)
            with marked_timer("old_log_prob", timing, role="actor"):
                batch.old_log_probs, metrics = self.actor.compute_log_prob(batch)
                worker_metrics.update(metrics)
            if "rollout_log_probs" in batch.extras:  # the engine's own log-probs: how far off-policy the samples are
                gap = (batch.old_log_probs - batch.extras["rollout_log_probs"]).abs()
                worker_metrics["rollout/log_prob_abs_diff"] = algos.masked_mean(gap, batch.response_mask).item()
            if self.ref is not None:
                with marked_timer("ref", timing, role="ref"):
                    batch.ref_log_probs, metrics = self.ref.compute_ref_log_prob(batch)
                    worker_metrics.update(metrics)
            if self.critic is not None:
                with marked_timer("values", timing, role="critic"):
                    batch.values = self.critic.compute_values(batch)
            with marked_timer("adv", timing, role="trainer"):
                worker_metrics.update(self.compute_advantages(batch))
            responses_per_mini_batch = self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size * self.sampling.n \
                // self.env.world_size
            if self.critic is not None:
                with marked_timer("update_critic", timing, role="critic"):
                    worker_metrics.update(self.critic.update(batch, responses_per_mini_batch))
            with marked_timer("update_actor", timing, role="actor"):
                worker_metrics.update(self.actor.update(batch, self.sampling.n))
            with marked_timer("update_weights", timing, role="rollout"):
                self.rollout.sync_weights()
        return self._step_metrics(step, batch, timing, worker_metrics)

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Token rewards (scores, minus the KL penalty when ``use_kl_in_reward``), then advantages and returns."""
        algorithm, metrics = self.cfg.algorithm, {}
        if algorithm.use_kl_in_reward:
            batch.token_level_rewards, current_kl = algos.apply_kl_in_reward(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.response_mask,
                self.kl_ctrl.coef, algorithm.kl_penalty)
            metrics = {"actor/reward_kl_penalty": current_kl.item(), "actor/reward_kl_penalty_coeff": self.kl_ctrl.coef}
            self.kl_ctrl.update(current_kl.item(), n_steps=batch.size * self.env.world_size)
        else:
            batch.token_level_rewards = batch.token_level_scores
        batch.advantages, batch.returns = algos.compute_advantage(
            algorithm.adv_estimator, batch.token_level_rewards, batch.response_mask, values=batch.values,
            index=batch.uid, gamma=algorithm.gamma, lam=algorithm.lam,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo)
        return metrics

    # ----------------------------------------------------------------------------------------- metrics

    def _step_metrics(self, step: int, batch: RolloutBatch, timing: dict[str, float],
                      worker_metrics: dict[str, float]) -> dict[str, float]:
        everything = _gather(self.env, {
            "worker": worker_metrics, "timing": timing,
            "tensors": {k: getattr(batch, k) for k in ("token_level_scores", "token_level_rewards", "advantages",
                                                        "returns", "values", "response_mask")},
            "prompt_lengths": batch.prompt_lengths(), "sequence_lengths": batch.sequence_lengths().tolist(),
        })
        tensors = {k: torch.cat([r["tensors"][k] for r in everything]) if everything[0]["tensors"][k] is not None
                   else None for k in everything[0]["tensors"]}
        seq_lens = [n for r in everything for n in r["sequence_lengths"]]
        prompt_tokens = int(sum(r["prompt_lengths"].sum() for r in everything))
        response_tokens = int(tensors["response_mask"].sum())
        metrics = {key: sum(r["worker"][key] for r in everything) / len(everything) for key in worker_metrics}
        metrics.update(compute_data_metrics(
            **tensors, prompt_lengths=torch.cat([r["prompt_lengths"] for r in everything]),
            max_response_length=self.sampling.response_length, max_prompt_length=self.cfg.data.max_prompt_length))
        metrics.update(compute_timing_metrics(timing, prompt_tokens, response_tokens))
        metrics.update(reduce_timing_across_ranks(timing) if self.env.world_size > 1 else {})
        metrics.update(compute_throughput_metrics(timing["step"], prompt_tokens + response_tokens, self.env.world_size,
                                                  num_samples=len(seq_lens), gen_seconds=timing["gen"]))
        epochs = self.cfg.actor_rollout_ref.actor.ppo_epochs
        metrics.update(mfu_metrics("actor", self.actor.module.config, seq_lens * epochs, timing["update_actor"],
                                   self.env.world_size))
        metrics.update(compute_memory_metrics())
        metrics.update({
            "training/global_step": float(step),
            "training/epoch": float(self.batches.epoch_of(step) + 1),
            "training/batch_fingerprint": float(zlib.crc32(str(sorted(set(batch.uid))).encode()) % 1_000_000),
        })
        return metrics

    def validate(self) -> dict[str, float]:
        """Mean reward per data source on the validation prompts (``val_kwargs`` sampling)."""
        if not self.val_examples:
            return {}
        val_kwargs = self.cfg.actor_rollout_ref.rollout.val_kwargs
        sampling = SamplingParams(val_kwargs.n, val_kwargs.temperature, 1.0, -1, self.sampling.response_length)
        prompts = self.val_examples[self.env.rank :: self.env.world_size]
        batch = self.rollout.generate(prompts, sampling)
        scores = self.reward.score(batch).sum(-1).tolist()
        results = [pair for r in _gather(self.env, list(zip(batch.data_source, scores))) for pair in r]
        per_source: dict[str, list[float]] = {}
        for source, score in results:
            per_source.setdefault(source, []).append(score)
        return {f"val-core/{source}/reward/mean@{val_kwargs.n}": sum(v) / len(v) for source, v in per_source.items()}

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    # ----------------------------------------------------------------------------------------- checkpoints

    def save(self, step: int) -> None:
        root = Path(self.cfg.trainer.default_local_dir)
        target = checkpoint.save(root, step, self._engines(), {"kl_coef": self.kl_ctrl.coef}, self.env.is_main,
                                 lambda: _barrier(self.env), self.cfg.trainer.max_actor_ckpt_to_keep)
        if self.env.is_main:
            self.log(f"checkpoint: saved {target}")

    def close(self) -> None:
        self.rollout.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def _gather(env: DistEnv, value: Any) -> list[Any]:
    """Every rank's ``value`` (a collective when there are several ranks)."""
    if env.world_size == 1:
        return [value]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return out


def _barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()
