"""Model FLOPs utilisation: FLOPs from a Hugging Face causal-LM config, peak FLOPs from a device table.

FLOPs are counted from the config's shapes, not from a list of known model types, so any decoder-only
transformer described with the usual Hugging Face field names works (dense, grouped-query attention, MoE with
routed and shared experts). Per token and layer, a multiply-add is 2 FLOPs:

- attention projections: ``2·h·(H·d) + 2·2·h·(K·d) + 2·(H·d)·h`` (q; k and v; o), H heads, K kv heads, d head_dim;
- attention itself, causal, counted once: for a sequence of s tokens ``2·H·d·s·(s+1)`` per layer (token i attends
  to i keys: ``4·d·i`` per head for QKᵀ and AV);
- MLP: ``2·m·h·i`` with m = 3 matrices for gated MLPs (SwiGLU/GeGLU: gate, up, down) or 2 otherwise; an MoE layer
  counts its router ``2·h·E``, ``top_k`` routed experts and its shared experts;
- the LM head ``2·h·V``.

A training step is forward + backward = 3 × forward. Gated MLPs are recognised from the activation (SiLU/Swish:
``hidden_act`` silu, swish, swiglu; geglu) or the model family (Gemma's MLP is gated with gelu_pytorch_tanh, while
GPTBigCode uses the same activation in a plain two-matrix MLP); ``gated_mlp=`` overrides.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

GATED_ACTIVATIONS = frozenset({"silu", "swish", "swiglu", "geglu"})
GATED_MODEL_TYPES = ("gemma",)
"""Model families (``model_type`` prefixes) whose MLP is gated whatever the activation is called."""

# Dense (no sparsity) BF16 tensor-core peak in TFLOP/s; longest name wins when several match the device name.
PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "B100": 1750.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "V100": 125.0,
    "RTX 4090": 165.0,
    "MI355X": 2500.0,
    "MI325X": 1307.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}
PEAK_ENV = "RLPROF_PEAK_TFLOPS"


class UnsupportedModel(ValueError):
    """The config lacks what the FLOPs count needs; the message names the missing field."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_matrices: int
    intermediate: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model (DeepSeek's first_k_dense_replace)


@dataclass(frozen=True)
class FlopsEstimate:
    """FLOPs of one pass over a batch: ``forward`` and ``training`` (= 3 × forward), and the token count."""

    forward: float
    tokens: int

    @property
    def training(self) -> float:
        return 3.0 * self.forward


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _require(config: Any, *names: str) -> int:
    value = _get(config, *names)
    if value is None:
        raise UnsupportedModel(f"the model config has none of {', '.join(names)}")
    return int(value)


def model_shape(config: Any, gated_mlp: Optional[bool] = None) -> ModelShape:
    """The shapes the FLOPs count needs, read from a HF config (object or dict); nested ``text_config`` is used."""
    config = _get(config, "text_config", default=config)
    hidden = _require(config, "hidden_size", "n_embd", "d_model")
    heads = _require(config, "num_attention_heads", "n_head")
    head_dim = int(_get(config, "head_dim", default=hidden // heads))
    activation = str(_get(config, "hidden_act", "hidden_activation", "activation_function", default="")).lower()
    model_type = str(_get(config, "model_type", default="")).lower()
    gated = (
        (activation in GATED_ACTIVATIONS or model_type.startswith(GATED_MODEL_TYPES))
        if gated_mlp is None
        else gated_mlp
    )
    experts = int(_get(config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    shape = dict(
        hidden=hidden,
        layers=_require(config, "num_hidden_layers", "n_layer", "num_layers"),
        heads=heads,
        kv_heads=int(_get(config, "num_key_value_heads", "num_kv_heads", default=heads)),
        head_dim=head_dim,
        vocab=_require(config, "vocab_size"),
        mlp_matrices=3 if gated else 2,
        intermediate=int(_get(config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden),
    )
    if experts:
        expert_intermediate = _get(config, "moe_intermediate_size", default=shape["intermediate"])
        shared = int(_get(config, "shared_expert_intermediate_size", default=0) or 0)
        shared += int(_get(config, "n_shared_experts", default=0) or 0) * int(expert_intermediate)
        shape.update(
            experts=experts,
            top_k=_require(config, "num_experts_per_tok", "moe_top_k"),
            expert_intermediate=int(expert_intermediate),
            shared_intermediate=shared,
            dense_layers=int(_get(config, "first_k_dense_replace", default=0) or 0),
        )
    return ModelShape(**shape)


def forward_flops_per_token_linear(shape: ModelShape) -> float:
    """Forward FLOPs per token of everything but attention's s-dependent part (projections, MLPs, LM head)."""
    h = shape.hidden
    q_o = 2 * 2 * h * shape.heads * shape.head_dim
    k_v = 2 * 2 * h * shape.kv_heads * shape.head_dim
    dense_mlp = 2 * shape.mlp_matrices * h * shape.intermediate
    if shape.experts:
        moe_mlp = 2 * h * shape.experts + 2 * shape.mlp_matrices * h * (
            shape.top_k * shape.expert_intermediate + shape.shared_intermediate
        )
        mlp_total = shape.dense_layers * dense_mlp + (shape.layers - shape.dense_layers) * moe_mlp
    else:
        mlp_total = shape.layers * dense_mlp
    return shape.layers * (q_o + k_v) + mlp_total + 2 * h * shape.vocab


def estimate_flops(config: Any, seq_lens: Sequence[int], gated_mlp: Optional[bool] = None) -> FlopsEstimate:
    """FLOPs of a forward pass over sequences of the given lengths (see the module doc for the formula)."""
    shape = config if isinstance(config, ModelShape) else model_shape(config, gated_mlp)
    tokens = int(sum(seq_lens))
    attention = sum(2 * shape.heads * shape.head_dim * s * (s + 1) for s in seq_lens) * shape.layers
    return FlopsEstimate(forward=tokens * forward_flops_per_token_linear(shape) + attention, tokens=tokens)


def device_name() -> str:
    """The CUDA device's name, or ``"cpu"``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return "cpu"


def cpu_peak_flops() -> Optional[float]:
    """Estimated fp32 vector peak of the cores this process may use: cores × max clock × FLOPs/cycle
    (64 with AVX-512, 32 with AVX2+FMA, 8 otherwise). None when the clock cannot be read."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    hz = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as handle:
            hz = int(handle.read()) * 1e3
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read()
        found = re.search(r"^flags\s*:(.*)$", info, re.M)
        flags = found.group(1) if found else ""
        if hz is None:
            mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
            hz = float(mhz.group(1)) * 1e6 if mhz else None
    except OSError:
        pass
    if hz is None:
        return None
    per_cycle = 64 if " avx512f" in flags else 32 if (" avx2" in flags and " fma" in flags) else 8
    return cores * hz * per_cycle


def peak_flops(name: Optional[str] = None, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one device: the override (argument, then ``$RLPROF_PEAK_TFLOPS``), else the table entry
    whose name is the longest one found in the device name, else the CPU estimate for ``"cpu"``; None if unknown."""
    if override_tflops is None and os.environ.get(PEAK_ENV):
        override_tflops = float(os.environ[PEAK_ENV])
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"peak TFLOP/s override={override_tflops} must be positive")
        return override_tflops * 1e12
    name = name or device_name()
    if name == "cpu":
        return cpu_peak_flops()
    matches = [key for key in PEAK_TFLOPS if key.lower() in name.lower()]
    return PEAK_TFLOPS[max(matches, key=len)] * 1e12 if matches else None


FAR_BELOW = 100.0
"""A peak more than this many times what the device reaches (a dense matmul measured on it, or the pass itself) is
taken to be wrong: a peak in the wrong unit, or another device's (a bf16 peak for an fp32 pass is 10-20x, and fair)."""

_matmul_rates: dict[str, float] = {}


def matmul_flops(name: str) -> Optional[float]:
    """FLOP/s of a dense square matmul measured once per process on the device called ``name`` when it is this
    process's (:func:`device_name`), else None: bf16 n=2048 on CUDA, fp32 n=512 on the CPU (the dtypes of the peak
    table and of the CPU estimate), the best of 5 after one warm-up. A rate a well-fed pass can reach, to check a
    peak against."""
    if name not in _matmul_rates:
        if name != device_name():
            return None
        try:
            import torch
        except ImportError:
            return None
        cuda = name != "cpu"
        n, dtype = (2048, torch.bfloat16) if cuda else (512, torch.float32)
        a = torch.randn(n, n, dtype=dtype, device="cuda" if cuda else "cpu")
        best = float("inf")
        for _ in range(6):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            a @ a
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        del a
        _matmul_rates[name] = 2 * n**3 / best
    return _matmul_rates[name]


_reported: set[str] = set()


def _warn_once(message: str, key: Optional[str] = None) -> None:
    """Warn with ``message`` the first time ``key`` (the message itself by default) is seen in this process."""
    if (key or message) not in _reported:
        _reported.add(key or message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _peak_source(name: str, override_tflops: Optional[float]) -> str:
    """Where :func:`peak_flops` took the peak from, in words."""
    if override_tflops is not None:
        return "given as peak_tflops"
    if os.environ.get(PEAK_ENV):
        return f"from ${PEAK_ENV}"
    if name == "cpu":
        return "estimated for this CPU"
    return f"the table's entry for {name!r}"


def mfu_metrics(
    role: str,
    config: Any,
    seq_lens: Sequence[int],
    seconds: float,
    num_devices: int = 1,
    *,
    training: bool = True,
    device: Optional[str] = None,
    peak_tflops: Optional[float] = None,
    gated_mlp: Optional[bool] = None,
) -> dict[str, float]:
    """``{"perf/mfu/{role}": achieved / peak}`` for a pass over ``seq_lens`` that took ``seconds`` on
    ``num_devices``; empty, with one warning saying why, when the model or the device is unknown. A value above 1,
    which no device reaches, is kept and warned about once per role, naming the peak it was divided by and where that
    came from (a peak too low, or a pass whose time or devices are not the ones its sequences ran in). So is a value
    far below what the device reaches: under ``1 / FAR_BELOW`` while the peak is more than ``FAR_BELOW`` times the
    rate of a dense matmul measured on the device (:func:`matmul_flops`, once per process) and of the pass itself."""
    try:
        flops = estimate_flops(config, seq_lens, gated_mlp)
    except UnsupportedModel as exc:
        _warn_once(f"perf/mfu/{role} is left out: cannot count the model's FLOPs ({exc})")
        return {}
    name = device or device_name()
    peak = peak_flops(name, peak_tflops)
    if peak is None:
        _warn_once(f"perf/mfu/{role} is left out: no peak FLOP/s known for device {name!r}; set ${PEAK_ENV}")
        return {}
    achieved = (flops.training if training else flops.forward) / seconds
    mfu = achieved / (peak * num_devices)
    if mfu > 1:
        _warn_once(
            f"perf/mfu/{role}={mfu:.2f} is above 1, which no device reaches: {achieved / 1e12:.3g} TFLOP/s achieved "
            f"against a peak of {peak / 1e12:.3g} TFLOP/s x {num_devices} device(s) "
            f"({_peak_source(name, peak_tflops)}); "
            f"set ${PEAK_ENV} to the device's peak, or check that {seconds:.3g} s and num_devices={num_devices} are "
            "the time and devices of this pass",
            key=f"mfu above 1/{role}",
        )
    elif mfu < 1 / FAR_BELOW and (matmul := matmul_flops(name)) is not None:
        reached = max(matmul, achieved / num_devices)
        if peak > FAR_BELOW * reached:
            _warn_once(
                f"perf/mfu/{role}={mfu:.2g} is far below what this device reaches: it ran a dense matmul at "
                f"{matmul / 1e12:.3g} TFLOP/s and this pass at {achieved / num_devices / 1e12:.3g}, while the peak "
                f"it is divided by is {peak / 1e12:.3g} TFLOP/s ({_peak_source(name, peak_tflops)}), "
                f"{peak / reached:.0f}x the faster; set ${PEAK_ENV} to the device's peak in TFLOP/s",
                key=f"mfu far below/{role}",
            )
    return {f"perf/mfu/{role}": mfu}
