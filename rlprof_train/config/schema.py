"""The trainer's configuration as typed dataclasses, one per section, a docstring per field (verl's key names).

``ppo_trainer.yaml`` beside this file holds the defaults with comments (verl's layout, so verl command lines carry
over); ``tests/rlprof_train/test_trainer_config.py`` checks that it and these classes agree key by key. Types and
ranges here are what :func:`rlprof_train.config.load_trainer_config` checks before any work starts: a wrong value
fails naming the key, the value and what is allowed. Each worker receives only its own section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from rlprof.typed_config import bounds
from rlprof.watchdog import WatchdogConfig

TrainerMode = Literal["sync", "one_step_off", "fully_async"]
"""Which trainer runs: ``main_ppo``'s (generation in the trainer's processes), or an asynchronous one with a
rollout pool of its own (:mod:`rlprof_train.one_step_off_policy`, :mod:`rlprof_train.fully_async_main`)."""

KLType = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Dtype = Literal["float32", "bfloat16"]
ProfilerBlock = Optional[dict[str, Any]]
"""A role's ``profiler`` block; rlprof checks it (``rlprof.config.RoleProfilerConfig``)."""


def _role_profiler() -> dict[str, Any]:
    return {"enable": True, "all_ranks": False, "ranks": [0]}


# ----------------------------------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Prompts: files or the built-in task, lengths, batch sizes."""

    train_files: Union[str, list[str], None] = None
    """verl-format parquet/JSONL file(s) of training prompts; null: the built-in task."""
    val_files: Union[str, list[str], None] = None
    """Validation files; null: a held-out split of the built-in task."""
    task: str = "arithmetic"
    """Built-in procedural task used when ``train_files`` is null: ``arithmetic`` (``"a+b="``, a 2-layer embedded
    model), ``reverse`` (``"Reverse the digits: 314 ->"``, responses as long as the input, a 4-layer model) or
    ``calculator`` (``"7*8="`` answered by calling the built-in calculator tool: a multi-turn rollout)."""
    task_max_operand: int = field(default=4, metadata=bounds(ge=0))
    """The built-in task's size: arithmetic operands drawn from 0..N; reverse strings of 1..N digits."""
    train_size: int = field(default=2000, metadata=bounds(ge=1))
    """Built-in task: number of training prompts."""
    val_size: int = field(default=64, metadata=bounds(ge=0))
    """Built-in task: number of validation prompts."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string or a list of chat messages)."""
    max_prompt_length: int = field(default=512, metadata=bounds(ge=1))
    """Prompt tokens; longer prompts follow ``truncation``."""
    max_response_length: int = field(default=512, metadata=bounds(ge=1))
    """Tokens generated per response."""
    truncation: Literal["error", "left", "right", "filter"] = "error"
    """Over-long prompts: error, left (keep the end), right (keep the start) or filter (drop the row)."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than ``max_prompt_length`` when the data is loaded, before ``truncation`` applies (verl)."""
    train_batch_size: int = field(default=1024, metadata=bounds(ge=1))
    """Prompts per training step over all ranks; each yields ``rollout.n`` responses."""
    gen_batch_size: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Prompts per generation round over all ranks (null: ``train_batch_size``). A step generates rounds from the
    prompt stream until it holds ``train_batch_size`` prompt groups (those ``algorithm.filter_groups`` keeps); the
    last round's surplus groups are dropped (verl's DAPO trainer)."""
    val_batch_size: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Validation prompts per generation call over all ranks; null: the whole validation set at once (verl)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from ``trainer.seed`` and the epoch)."""
    apply_chat_template: Union[bool, Literal["auto"]] = "auto"
    """Apply the tokenizer's chat template to chat prompts: auto (when it has one), true or false."""


# ----------------------------------------------------------------------------------------------- actor, ref, rollout


@dataclass
class ModelConfig:
    """The policy model shared by actor, reference and rollout."""

    path: Optional[str] = None
    """Local Hugging Face causal-LM directory; null: build the embedded tiny model."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward (less memory, more compute)."""
    enable_activation_offload: bool = False
    """Keep saved activations on the host (GPU only; a no-op on CPU)."""
    use_remove_padding: bool = True
    """Sequence packing: forward passes over real tokens only."""
    torch_compile: bool = False
    """Compile the policy's forward for the training passes (update, old log-probs, reference): ``torch.compile``
    with dynamic shapes, so packed lengths and micro-batch widths share one graph (one per pass kind: with and
    without gradients). Costs its compile at the first passes; not with ``actor.zero_stage=3``. Opt-in (verl's
    ``use_torch_compile``, which compiles its entropy, is a different key)."""
    dtype: Dtype = "float32"
    """Parameters and compute dtype of actor, critic and reference."""
    lora_rank: int = field(default=0, metadata=bounds(ge=0))
    """LoRA adapters of this rank on the policy (PEFT); only they train, the reference is the base model with the
    adapters disabled, vLLM gets the merged weights. 0: full fine-tuning."""
    lora_alpha: float = field(default=16, metadata=bounds(gt=0))
    """LoRA scaling numerator (the adapters' update is scaled by ``lora_alpha / lora_rank``)."""
    target_modules: Union[str, list[str]] = "all-linear"
    """Modules that get adapters: ``all-linear`` (every linear layer but the output head) or a list of names."""
    exclude_modules: Optional[Union[str, list[str]]] = None
    """Modules left without adapters (names or a regex)."""
    lora_adapter_path: Optional[str] = None
    """Start from this saved PEFT adapter (a folder with ``adapter_config.json``) instead of new adapters."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Settings of the model's Hugging Face config replaced when it is loaded (actor, reference, and vLLM's
    ``hf_overrides``), e.g. ``max_position_embeddings``; a key the config does not have is set as verl sets it and
    named in the log (it has no effect)."""


@dataclass
class OptimConfig:
    """AdamW settings and the learning-rate schedule over training steps (verl's FSDP optimizer config)."""

    lr: float = field(default=1e-6, metadata=bounds(gt=0))
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Steps of linear warm-up from 0 to ``lr``; <= 0: ``lr_warmup_steps_ratio`` of the run's steps."""
    lr_warmup_steps_ratio: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    """Warm-up as a share of ``trainer.total_training_steps`` (rounded down), when ``lr_warmup_steps`` <= 0."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """After the warm-up: ``constant`` (``lr``), or ``cosine`` (a cosine from ``lr`` down to ``min_lr_ratio``·lr at
    the last step); verl's deprecated ``warmup_style`` is the same setting."""
    min_lr_ratio: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    """cosine: the floor, as a share of ``lr``."""
    num_cycles: float = field(default=0.5, metadata=bounds(gt=0))
    """cosine: waves over the decay (0.5: one half-wave from ``lr`` to the floor)."""
    zero_indexed_step: bool = True
    """cosine: count the schedule's steps from 0 (verl's default; false: from 1, as torchtitan)."""
    weight_decay: float = field(default=0.01, metadata=bounds(ge=0))
    """Weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    fused: bool = True
    """torch's fused AdamW kernel (one pass over each tensor; the same update up to float rounding, transformers'
    default); false: torch's loop over the tensors. Not used with ``offload_optimizer`` (DeepSpeed's CPU Adam)."""


@dataclass
class FsdpCompatConfig:
    """verl's FSDP knobs, kept so verl command lines get a clear answer."""

    offload_policy: bool = False
    """Maps to DeepSpeed parameter + optimizer offload (ZeRO 3)."""
    forward_prefetch: bool = False
    """FSDP only; DeepSpeed ZeRO 3 prefetches by itself (refused when true)."""


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss``: which policy objective the update minimises."""

    loss_mode: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    """``vanilla``: PPO's clipped surrogate with dual clip; ``gspo``: GSPO's sequence-level ratio, clipped (always
    seq-mean-token-mean, as verl); ``cispo``: CISPO's clipped, stop-gradient ratio weighting ``A·log π``. verl's other
    registered modes (dppo_tv, dppo_kl, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, bypass_mode) are not here."""


@dataclass
class ActorConfig:
    """The policy's DeepSpeed engine and its PPO update."""

    strategy: str = "deepspeed"
    """deepspeed: the only strategy of this trainer (verl's fsdp/fsdp2/megatron are refused with the keys to use)."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage. ZeRO 1 and 2 run as stage 0 on one float32 process without offload (nothing to
    partition; a startup line says so), unless the run resumes optimizer state a ZeRO engine saved."""
    offload_optimizer: bool = False
    """ZeRO >= 1: optimizer state on the host (DeepSpeedCPUAdam)."""
    offload_param: bool = False
    """ZeRO 3: parameters on the host."""
    overlap_comm: Optional[bool] = None
    """ZeRO >= 1: reduce gradients while backward still runs (DeepSpeed's ``zero_optimization.overlap_comm``);
    null: DeepSpeed's default (on at ZeRO 3, off at 1 and 2)."""
    ppo_mini_batch_size: int = field(default=256, metadata=bounds(ge=1))
    """Prompts per optimizer step (times ``rollout.n`` responses), over all ranks."""
    ppo_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per forward/backward on one rank (a speed/memory knob: the gradient is the same); null: set it, or
    ``use_dynamic_bsz`` (verl requires one of them too)."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget instead of a fixed size."""
    ppo_max_token_len_per_gpu: int = field(default=16384, metadata=bounds(ge=1))
    """Token budget of one micro-batch when ``use_dynamic_bsz``."""
    ppo_epochs: int = field(default=1, metadata=bounds(ge=1))
    """Passes over each batch."""
    shuffle: bool = False
    """Shuffle responses before splitting into mini-batches."""
    reuse_on_policy_log_probs: bool = False
    """Skip the old-log-prob pass when the update is on-policy (``ppo_epochs=1`` and one mini-batch per step): the
    old log-probs are the detached log-probs of the update's own forward (the ratio is exactly 1, as TRL's
    GRPOTrainer and verl's dp_actor take them on-policy) and ``actor/entropy`` comes from that forward. Not applied
    (a startup line says why) with ``algorithm.use_kl_in_reward`` (it needs them before the update) or the vLLM
    rollout (``rollout/log_prob_abs_diff`` compares them with the engine's)."""
    clip_ratio: float = field(default=0.2, metadata=bounds(gt=0))
    """PPO ratio clip epsilon (both sides unless the two below are set)."""
    clip_ratio_low: Optional[float] = field(default=0.2, metadata=bounds(gt=0))
    """Lower clip epsilon."""
    clip_ratio_high: Optional[float] = field(default=0.2, metadata=bounds(gt=0))
    """Upper clip epsilon (DAPO's clip-higher)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy objective (verl's ``policy_loss.loss_mode``)."""
    clip_ratio_c: Optional[float] = field(default=3.0, metadata=bounds(gt=1))
    """Dual-clip bound for negative advantages (> 1); null disables dual clip (vanilla only)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become one number (GSPO: always seq-mean-token-mean)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight in the actor loss."""
    entropy_checkpointing: bool = False
    """Recompute the entropy's softmax in backward instead of keeping it."""
    entropy_from_logits_with_chunking: bool = False
    """Compute the actor's entropies a chunk of positions at a time (lower peak memory)."""
    use_kl_loss: bool = False
    """Add KL(actor || ref) to the loss (GRPO style)."""
    kl_loss_coef: float = field(default=0.001, metadata=bounds(ge=0))
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the loss: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))
    """Gradient norm clip."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer."""
    fsdp_config: FsdpCompatConfig = field(default_factory=FsdpCompatConfig)
    """verl's FSDP knobs."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``actor`` (rollout and ref follow it unless they have their own block)."""


@dataclass
class RefConfig:
    """The frozen reference policy's log-prob pass."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per reference forward on one rank; null: set it, or ``log_prob_use_dynamic_bsz``."""
    log_prob_use_dynamic_bsz: bool = False
    """Micro-batches by token budget (defaults to ``actor.use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: int = field(default=16384, metadata=bounds(ge=1))
    """Token budget of one micro-batch (defaults to ``actor.ppo_max_token_len_per_gpu``)."""
    entropy_from_logits_with_chunking: bool = False
    """Compute the reference's entropies (``ref/entropy``) a chunk of positions at a time."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``ref``."""


@dataclass
class ValKwargs:
    """Sampling for validation (verl's ``val_kwargs``)."""

    do_sample: bool = False
    """Sample with the settings below; false: greedy, whatever they say (verl)."""
    temperature: float = field(default=0.0, metadata=bounds(ge=0))
    """Sampling temperature when ``do_sample`` (0: greedy)."""
    top_p: float = field(default=1.0, metadata=bounds(gt=0, le=1))
    """Nucleus sampling when ``do_sample``."""
    top_k: int = field(default=-1, metadata=bounds(ge=-1))
    """Top-k sampling when ``do_sample``; -1 = off."""
    n: int = field(default=1, metadata=bounds(ge=1))
    """Responses per validation prompt."""


@dataclass
class RolloutPrometheusConfig:
    """verl's ``rollout.prometheus``: the engine's metrics for a Prometheus server. vLLM's ``vllm:*`` series are served
    through each rank's ``prometheus`` endpoint (the engine runs in the rank's process), and rank 0 writes the server's
    configuration and asks it to reload, as verl does for its rollout servers."""

    enable: bool = False
    """Serve the engine's series (adds ``prometheus`` to ``trainer.logger``; needs vLLM with
    ``disable_log_stats=false``) and write ``file``."""
    port: int = field(default=9090, metadata=bounds(ge=1, le=65535))
    """The Prometheus server's port on this node: rank 0 posts ``/-/reload`` there after writing ``file``."""
    file: str = "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml"
    """The server's configuration, written by rank 0: a job ``rlprof`` whose targets are the run's targets files (so
    it stays current as ranks come and go)."""
    served_model_name: Optional[str] = None
    """The ``model_name`` label of the engine's series (verl: the model's path, shortened here to its folder name
    when null)."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollout with tool calls (verl's ``rollout.multi_turn``; :mod:`rlprof_train.agent`)."""

    enable: bool = False
    """Generate until a tool call or the end, run the called tools, append their replies, repeat."""
    max_assistant_turns: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Generation turns per trajectory; null: until the response length is used up."""
    max_user_turns: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Tool-reply turns per trajectory; null: no limit."""
    max_parallel_calls: int = field(default=1, metadata=bounds(ge=1))
    """Tool calls run per turn (the first ones of the turn; verl's default 1)."""
    max_tool_response_length: int = field(default=256, metadata=bounds(ge=1))
    """Characters of a tool's reply kept (the rest cut as ``tool_response_truncate_side`` says)."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a long reply is kept: left (its start), right (its end), middle (start and end)."""
    tool_config_path: Optional[str] = None
    """verl's tool YAML: ``tools:`` entries of ``class_name``, ``config`` and ``tool_schema`` (OpenAI function)."""
    format: Literal["hermes"] = "hermes"
    """How the model writes a call: hermes, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    tool_timeout_s: float = field(default=30.0, metadata=bounds(gt=0))
    """A tool call running longer gets an error reply (counted as a failure) and the trajectory goes on."""


@dataclass
class RolloutConfig:
    """Generation (HF generate or vLLM) and the old-log-prob pass."""

    name: str = "hf"
    """A registered rollout backend: hf (transformers generate), vllm, or your own (``register_rollout``)."""
    temperature: float = field(default=1.0, metadata=bounds(ge=0))
    """Sampling temperature (0: greedy)."""
    top_p: float = field(default=1.0, metadata=bounds(gt=0, le=1))
    """Nucleus sampling: keep the most likely tokens up to this probability mass."""
    top_k: int = field(default=-1, metadata=bounds(ge=-1))
    """Top-k sampling; -1 = off."""
    n: int = field(default=1, metadata=bounds(ge=1))
    """Responses per prompt (GRPO/RLOO groups)."""
    response_length: int = field(default=512, metadata=bounds(ge=1))
    """New tokens per response (defaults to ``data.max_response_length``)."""
    micro_batch_size: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """hf: prompts per sampling call; null = the whole batch, as verl's hf rollout. Each response's noise is keyed
    by its prompt, so the chunking changes the cost and the memory of a call, not the samples (tune searches it)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per old-log-prob forward on one rank; null: set it, or ``log_prob_use_dynamic_bsz``."""
    log_prob_use_dynamic_bsz: bool = False
    """Old-log-prob micro-batches by token budget (defaults to ``actor.use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: int = field(default=16384, metadata=bounds(ge=1))
    """Token budget of one old-log-prob micro-batch (defaults to ``actor.ppo_max_token_len_per_gpu``)."""
    gpu_memory_utilization: float = field(default=0.5, metadata=bounds(gt=0, le=1))
    """vLLM: share of device memory for weights and KV cache."""
    max_num_batched_tokens: int = field(default=8192, metadata=bounds(ge=1))
    """vLLM: tokens per engine step."""
    tensor_parallel_size: int = field(default=1, metadata=bounds(ge=1))
    """vLLM: tensor-parallel degree."""
    disable_log_stats: bool = True
    """vLLM: keep no engine statistics (verl's default). ``false``: the engine times each request, and every step
    logs its counters (``rollout/engine/*``: queue time, time to first token, per-token time, preemptions,
    prefix-cache hits; :mod:`rlprof_train.workers.rollout.engine_stats`)."""
    enforce_eager: bool = True
    """No compiled decoding (fast start). ``false``: vLLM captures CUDA graphs; the hf rollout samples with a static
    KV cache and a compiled decode step (transformers' ``torch.compile``, CUDA graphs on a GPU; batch and length
    bucketed to powers of two so that few shapes compile), compiled before the first step and timed as
    ``timing_s/rollout_compile``. Not with ZeRO 3 on hf."""
    max_num_seqs: int = field(default=256, metadata=bounds(ge=1))
    """vLLM: sequences per engine step."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prefills into chunks of ``max_num_batched_tokens``."""
    enable_prefix_caching: bool = True
    """vLLM: reuse the KV cache of shared prompt prefixes (the n responses of a prompt)."""
    max_model_len: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """vLLM: context length; null = prompt + response length."""
    dtype: Dtype = "float32"
    """vLLM: weight dtype (defaults to ``model.dtype``)."""
    kv_cache_space_gb: int = field(default=1, metadata=bounds(ge=1))
    """vLLM on CPU: KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, unless you set that variable)."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Validation sampling."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-calling rollout."""
    prometheus: RolloutPrometheusConfig = field(default_factory=RolloutPrometheusConfig)
    """verl's: the engine's metrics for Prometheus (vLLM)."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``rollout``."""


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hybrid_engine: bool = True
    """verl: the rollout in the actor's processes. ``main_ppo`` runs only that (false is refused there: launch the
    one-step-off trainer, whose rollout pool is always apart; it accepts either value, as verl's scripts set false)."""


# ----------------------------------------------------------------------------------------------------- critic, reward


@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    """Value model initialised from this causal-LM directory (defaults to the policy's)."""
    enable_gradient_checkpointing: bool = True
    """Recompute the value model's activations in backward (verl's default for the critic)."""
    enable_activation_offload: bool = False
    """Keep the value model's saved activations on the host (GPU only)."""
    use_remove_padding: bool = False
    """Sequence packing for the value model's passes (verl's default for the critic: off)."""


@dataclass
class CriticConfig:
    """The value model's DeepSpeed engine and its update."""

    enable: Optional[bool] = None
    """null: only when the advantage estimator needs values (gae)."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Where the value model starts from."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage of the critic (defaults to the actor's)."""
    overlap_comm: Optional[bool] = None
    """Gradient reduction during backward, as the actor's (defaults to the actor's)."""
    offload_optimizer: bool = False
    """ZeRO >= 1: the critic's optimizer state on the host (verl: ``critic.model.fsdp_config.optimizer_offload``)."""
    offload_param: bool = False
    """ZeRO 3: the critic's parameters on the host (verl: ``critic.model.fsdp_config.param_offload``)."""
    ppo_mini_batch_size: int = field(default=256, metadata=bounds(ge=1))
    """Prompts per critic optimizer step over all ranks (defaults to the actor's)."""
    ppo_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per forward/backward on one rank; null: set it, or ``use_dynamic_bsz``."""
    forward_micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per value forward (no gradient) on one rank (defaults to ``ppo_micro_batch_size_per_gpu``)."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget (defaults to ``actor.use_dynamic_bsz``)."""
    ppo_max_token_len_per_gpu: int = field(default=32768, metadata=bounds(ge=1))
    """Token budget of one update micro-batch when ``use_dynamic_bsz``."""
    forward_max_token_len_per_gpu: int = field(default=32768, metadata=bounds(ge=1))
    """Token budget of one value-forward micro-batch (defaults to ``ppo_max_token_len_per_gpu``)."""
    ppo_epochs: int = field(default=1, metadata=bounds(ge=1))
    """Passes over each batch (defaults to the actor's)."""
    cliprange_value: float = field(default=0.5, metadata=bounds(gt=0))
    """Value clip around the rollout-time values."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Aggregation of the value loss (defaults to the actor's)."""
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))
    """Gradient norm clip."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The critic's optimizer."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``critic``."""


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    """A sequence-classification model directory (``AutoModelForSequenceClassification``); its last label's logit
    for prompt and response is the score."""
    trust_remote_code: bool = False
    """Let transformers run the model directory's own code."""
    use_remove_padding: bool = False
    """verl's key: responses are scored padded here, so only false is honoured."""


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a response longer than ``max_resp_len - len`` tokens loses
    ``penalty_factor · (length - (max_resp_len - len)) / len`` of reward, up to ``penalty_factor`` at
    ``max_resp_len`` (verl's ``overlong_buffer_cfg``)."""

    enable: bool = False
    """Penalise over-long responses (``reward_manager=dapo``)."""
    len: int = field(default=0, metadata=bounds(ge=0))
    """Tokens of the buffer before ``max_resp_len`` over which the penalty grows (> 0 when enabled)."""
    penalty_factor: float = field(default=1.0, metadata=bounds(ge=0))
    """The penalty at ``max_resp_len``."""
    max_resp_len: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """The response length the buffer ends at (null: ``data.max_response_length``; at least ``len``)."""
    log: bool = False
    """Log ``reward_extra/overlong_reward`` and ``reward_extra/overlong`` (the share penalised) each step."""


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score responses with ``reward_model.model`` (as verl: that score replaces the rule reward; a
    ``custom_reward_function.path`` takes precedence over both)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model."""
    micro_batch_size_per_gpu: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Responses per reward-model forward on one rank (null: all of the rank's batch in one)."""
    max_length: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Truncate the reward model's input to this many tokens, from the left (null: no limit)."""
    reward_manager: Literal["naive", "dapo"] = "naive"
    """naive: one score per response (the rule reward chosen by data_source, or the reward model's); dapo: the same
    scores, plus ``overlong_buffer``'s penalty when it is enabled (verl's DAPO reward manager)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (``reward_manager=dapo``)."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``reward``."""


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    """Python file with your reward function; overrides the built-in ones."""
    name: str = "compute_score"
    """Its name: ``f(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``."""
    timeout_s: Optional[float] = field(default=None, metadata=bounds(gt=0))
    """Stop with an error naming the sample when one call takes longer (null: no limit)."""


# ----------------------------------------------------------------------------------------------------- algorithm


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed or adaptive (Ziegler et al.)."""
    kl_coef: float = field(default=0.001, metadata=bounds(ge=0))
    """beta (the initial beta when adaptive)."""
    target_kl: float = field(default=0.1, metadata=bounds(gt=0))
    """Adaptive: the KL the controller steers to."""
    horizon: int = field(default=10000, metadata=bounds(ge=1))
    """Adaptive: samples over which beta adapts."""


@dataclass
class RolloutCorrectionConfig:
    """verl's correction between the policy that sampled the responses (the rollout's log-probs) and the one that
    trains on them (:mod:`rlprof_train.rollout_correction`); everything off by default."""

    rollout_is: Optional[str] = None
    """Importance weights per ``token`` or per ``sequence`` (null: none)."""
    rollout_is_threshold: Optional[Union[float, str]] = 2.0
    """u: weights truncated at u (TIS); ``"l_u"``: weights outside [l, u] zeroed (IcePop); null only without
    ``rollout_is``."""
    rollout_rs: Optional[str] = None
    """Rejection, comma-separated options that must all pass: token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    seq_max_k2|k3 (null: none)."""
    rollout_rs_threshold: Optional[Union[float, str]] = None
    """One threshold for every option or one per option (comma-separated); k1 options take ``"l_u"`` (ratio bounds)
    or u (for [1/u, u]), the others an upper bound on the divergence."""
    bypass_mode: bool = False
    """The rollout's log-probs are the old log-probs (no recomputation); each micro-batch of the update computes the
    weights and rejection from the current policy."""
    loss_type: str = "ppo_clip"
    """In bypass mode: ``ppo_clip`` (PPO's clipped ratio against the rollout's policy) or ``reinforce``
    (-w·A·log π with the importance weights w)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their mean over the batch (tokens, or responses for ``sequence``)."""


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: prompt groups whose ``metric`` is the same for every response teach nothing (GRPO's
    advantages are 0) and are dropped; generation goes on with the next prompts until the step is full."""

    enable: bool = False
    """Drop groups without variance in ``metric`` and generate more rounds (``data.gen_batch_size`` prompts each)."""
    metric: Optional[str] = None
    """A reward's per-response number: ``acc`` or ``score`` (verl's DAPO reward gives both; other keys of a reward
    function's dict), ``seq_reward`` (the response's score) or ``seq_final_reward`` (its reward after the in-reward
    KL)."""
    max_num_gen_batches: int = 0
    """Generation rounds a step may take; the step stops the run at the limit, saying how many groups it kept.
    <= 0: no limit."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """A registered estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or your own."""
    gamma: float = field(default=1.0, metadata=bounds(ge=0, le=1))
    """Discount."""
    lam: float = field(default=1.0, metadata=bounds(ge=0, le=1))
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """false: Dr.GRPO (no division by the group's std)."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(actor || ref) from token rewards."""
    kl_penalty: KLType = "kl"
    """Estimator of the in-reward KL."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """beta's controller."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection between the rollout's policy and the trained one (verl's)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""


# ----------------------------------------------------------------------------------------------------- trainer


@dataclass
class PrometheusConfig:
    """Where each rank serves its metrics when ``trainer.logger`` holds ``prometheus`` (or verl's ``rl_insight``)."""

    host: str = "127.0.0.1"
    """Address to serve on: the loopback (a server on the same node scrapes it), or ``0.0.0.0`` for every interface
    (a server elsewhere; the targets file then names this node's host name)."""
    port: int = field(default=9490, metadata=bounds(ge=1, le=65535))
    """Base port: each rank serves on this + its local rank (``http://{host}:{port + LOCAL_RANK}/metrics``)."""


@dataclass
class TrainerSection:
    """Run length, logging, checkpoints and guards."""

    project_name: str = "rlprof"
    """Tracker project (a plain name: no path separators)."""
    experiment_name: str = "ppo-demo"
    """Tracker experiment / run name (a plain name: no path separators)."""
    logger: Union[list[str], str] = field(default_factory=lambda: ["console", "file"])
    """Tracking backends: console, tensorboard, file, wandb, mlflow, prometheus (or verl's rl_insight: the same, with
    RL-Insight's names) (a list, or a string holding one)."""
    total_epochs: int = field(default=30, metadata=bounds(ge=1))
    """Passes over the training prompts (unless ``total_training_steps`` stops the run first)."""
    total_training_steps: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Stop after this many steps (null: total_epochs decides)."""
    save_freq: int = -1
    """Checkpoint every N steps and at the end (-1: never)."""
    test_freq: int = -1
    """Validate every N steps and at the end (-1: never)."""
    critic_warmup: int = field(default=0, metadata=bounds(ge=0))
    """Steps before the policy's first update: until step ``critic_warmup`` only the critic trains (verl: the actor
    updates once ``critic_warmup <= step``)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    log_val_generations: int = field(default=0, metadata=bounds(ge=0))
    """After each validation, this many of its (prompt, response, score) samples, chosen as verl chooses them (sorted
    by prompt, shuffled with seed 42, the first N), as one line of ``{trainer.log_dir}/val_generations.jsonl``."""
    default_local_dir: str = "outputs/checkpoints/rlprof/ppo-demo"
    """Checkpoints (must be shared by all nodes of a multi-node run)."""
    log_dir: str = "outputs/logs/rlprof/ppo-demo"
    """metrics.jsonl, the run's config and state: what ``rlprof report`` reads."""
    resume_mode: str = "auto"
    """auto (latest complete checkpoint if any), disable, or a global_step_N directory inside default_local_dir."""
    collective_timeout_s: float = field(default=600.0, metadata=bounds(gt=0))
    """A collective (gradient all-reduce, metrics gather, weight broadcast) waiting longer than this for a rank stops
    the job, naming the rank that stopped answering and where each rank was (the process group's timeout)."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Settings that change the experiment (optimizer, batch geometry, n, seed, estimator, models, rewards) a resume may
    change from the checkpoint's, applied for real and logged; any other such difference stops the resume."""
    max_actor_ckpt_to_keep: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Keep at most this many checkpoints (null: all)."""
    max_critic_ckpt_to_keep: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Accepted for verl compatibility: checkpoints hold actor and critic together."""
    seed: int = 1
    """Seeds data order and sampling."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``cuda`` (GPU ``LOCAL_RANK`` of the node for each process), ``cpu``, or ``auto`` (CUDA where
    torch sees a GPU)."""
    table_every: int = field(default=50, metadata=bounds(ge=1))
    """Console: a table of all metrics and the step's time split every N steps."""
    nonfinite_patience: int = field(default=1, metadata=bounds(ge=1))
    """Stop after this many consecutive steps with a non-finite loss or gradient norm. 1: the first such step (in
    float32 and bfloat16 no loss scaler lowers its scale and retries: DeepSpeed skips a bf16 step whose gradients
    overflowed, and the next batch like it overflows again; a float32 step's update reaches the weights)."""
    tracker_start_timeout_s: float = field(default=60.0, metadata=bounds(gt=0))
    """A tracking backend that does not start within this time (unreachable server) is turned off."""
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    """The ``prometheus`` logger's endpoints: every rank serves its own (its timings and memory; rank 0's the run's
    metrics too), listed in ``{trainer.log_dir}/prometheus_targets/`` for a server's ``file_sd_configs``."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The stall watchdog: a phase of a step running far longer than it usually does makes every rank write its
    threads' stacks to ``{trainer.log_dir}/stalls/step{N}/rank{R}.txt``; rank 0 logs one line naming the rank furthest
    behind (:mod:`rlprof.watchdog`)."""
    profiler: ProfilerBlock = field(default_factory=_role_profiler)
    """rlprof role ``trainer`` (step, adv, ...)."""


@dataclass
class RolloutPoolConfig:
    """The rollout's own pool of processes (verl's top-level ``rollout`` block of its asynchronous trainers): the
    last ``nnodes * n_gpus_per_node`` processes of the launch generate, the others train (:mod:`rlprof_train.pools`)."""

    nnodes: int = field(default=1, metadata=bounds(ge=1))
    """Nodes of the rollout pool (as ``trainer.nnodes``: the launch's nodes)."""
    n_gpus_per_node: int = field(default=0, metadata=bounds(ge=0))
    """Rollout processes on each node (0: no pool of its own, the ``main_ppo`` trainer's generation in its own
    processes; the asynchronous trainers need at least 1)."""
    total_rollout_steps: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """The fully-async trainer: prompts the run generates for, over all epochs (verl's name; its samples are prompt
    groups); null: ``trainer.total_epochs`` of the training set."""


@dataclass
class AsyncTrainingConfig:
    """The fully-async trainer's pipeline (verl's ``async_training`` block; :mod:`rlprof_train.fully_async_main`).

    A local update takes ``required = actor.ppo_mini_batch_size * require_batches`` prompt groups from the queue;
    every ``trigger_parameter_sync_step`` local updates the weights go to the rollout pool (one parameter version,
    one logged step). The rollout pool samples ahead of the trainer by at most
    ``max_required = required * (1 + staleness_threshold) * trigger_parameter_sync_step`` groups not yet trained on,
    which also bounds the queue (verl's ``max_queue_size``)."""

    staleness_threshold: float = field(default=0.1, metadata=bounds(ge=0))
    """How far past one sync's samples the rollout may sample ahead, as a fraction of them."""
    trigger_parameter_sync_step: int = field(default=4, metadata=bounds(ge=1))
    """Local updates between two weight syncs."""
    require_batches: int = field(default=1, metadata=bounds(ge=1))
    """PPO mini-batches of prompt groups each local update takes from the queue."""
    partial_rollout: bool = True
    """Samples in flight at a weight sync pause for it and go on with the new weights (each trajectory records the
    first and last versions its tokens were drawn under); false: the sync waits for the group in flight, which
    finishes on the weights it started with. Here a rollout process samples its groups in flight
    ``partial_rollout_segment`` tokens at a time and looks for a sync between two segments (continuing backends;
    multi-turn conversations between two calls of the multi-turn loop)."""
    concurrent_samples_per_replica: int = field(default=16, metadata=bounds(ge=1))
    """Prompt groups a rollout process samples at once (one batched call: verl's requests in flight per replica),
    at most those the budget lets it sample and its share of a local update's (a call's groups come back together)."""
    partial_rollout_segment: int = field(default=256, metadata=bounds(ge=1))
    """rlprof's: with partial rollouts, the tokens a rollout process samples of its groups in flight before it looks
    for a sync again (a sync waits at most one segment). Each segment is a sampling call that re-reads every
    trajectory's context, a cost longer segments spread: responses up to 256 tokens are sampled whole, longer ones
    (verl's 8k-token DAPO runs) cut."""


@dataclass
class TrainerConfig:
    """The whole configuration (``ppo_trainer.yaml`` plus overrides)."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    """The asynchronous trainers' rollout pool."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """The fully-async trainer's pipeline."""
    global_profiler: dict[str, Any] = field(default_factory=dict)
    """rlprof's global block; checked by ``rlprof.config.load_config``."""


def as_dict(cfg: TrainerConfig) -> dict[str, Any]:
    """The configuration as plain nested data (for trackers, the saved run config and rlprof)."""
    return dataclasses.asdict(cfg)
