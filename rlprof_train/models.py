"""Models of the trainer: loading local Hugging Face models, the critic's value model, and the log-prob / entropy
pass the actor and the reference share. The embedded tiny model is built in :mod:`rlprof_train.tiny_model`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rlprof_train import algos
from rlprof_train.batch import pack


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def overridden_config(path: str | Path, overrides: dict[str, Any]) -> tuple[Any, list[str]]:
    """The model's Hugging Face config with ``overrides`` set (``model.override_config``), as verl's
    ``update_model_config`` sets them (a dict value into the sub-config of that name), and the overridden keys the
    config did not have (set all the same, as verl does: no model code reads them)."""
    from transformers import AutoConfig, PretrainedConfig

    def apply(target: Any, values: dict[str, Any], prefix: str) -> list[str]:
        unknown = []
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(getattr(target, key, None), PretrainedConfig):
                unknown += apply(getattr(target, key), value, f"{prefix}{key}.")
                continue
            if not hasattr(target, key):
                unknown.append(prefix + key)
            setattr(target, key, value)
        return unknown

    config = AutoConfig.from_pretrained(str(path))
    return config, apply(config, overrides, "")


def load_causal_lm(
    path: str | Path,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    lora: Any = None,
    device: Optional[torch.device] = None,
    overrides: Optional[dict[str, Any]] = None,
) -> Any:
    """A local causal LM in training mode, loaded onto ``device`` (None: the host, for a DeepSpeed engine to place as
    its ZeRO stage and offload say), its config with ``overrides`` (:func:`overridden_config`); with ``lora`` (a
    :class:`~rlprof_train.config.schema.ModelConfig` whose ``lora_rank > 0``) wrapped in PEFT LoRA adapters, only
    they trainable (:func:`with_lora`)."""
    from transformers import AutoModelForCausalLM

    config = overridden_config(path, overrides)[0] if overrides else None
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=TORCH_DTYPES[dtype])
    if device is not None:
        model = model.to(device)
    model.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None and lora.lora_rank > 0:
        model = with_lora(model, lora)
    return model


def with_lora(model: Any, cfg: Any) -> Any:
    """``model`` with PEFT LoRA adapters (rank ``cfg.lora_rank``, scale ``lora_alpha / lora_rank``, on
    ``target_modules`` but ``exclude_modules``), or the saved adapter at ``cfg.lora_adapter_path``: a
    ``peft.PeftModel`` whose only trainable parameters are the adapters'."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if cfg.lora_adapter_path:
        return PeftModel.from_pretrained(model, cfg.lora_adapter_path, is_trainable=True)
    config = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=cfg.target_modules,
        exclude_modules=cfg.exclude_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merged_state_dict(module: Any) -> dict[str, torch.Tensor]:
    """The weights as the base model names them: for a PEFT model each adapted layer's ``W + ΔW`` (PEFT's
    ``get_delta_weight``: ``B·A·lora_alpha/r``), computed beside the layer so the trained weights are left bit for bit
    as they were (merging in place and back would round them); anything else's own state dict."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, PeftModel):
        return dict(module.state_dict())
    base = module.get_base_model()
    merged = {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in base.state_dict().items()
        if ".lora_" not in name
    }
    with torch.no_grad():
        for name, layer in base.named_modules():
            if isinstance(layer, LoraLayer):
                adapted: Any = layer  # a Linear / Embedding / Conv LoRA layer: each defines get_delta_weight
                for adapter in adapted.active_adapters:
                    merged[f"{name}.weight"] = merged[f"{name}.weight"] + adapted.get_delta_weight(adapter)
    return merged


def trainable_parameters(module: Any) -> tuple[int, int]:
    """(trainable, all) parameter counts (whole tensors: ZeRO 3 keeps a partition in ``numel`` and the size in
    ``ds_numel``)."""
    params = list(module.parameters())
    sizes = [getattr(p, "ds_numel", None) or p.numel() for p in params]
    return sum(n for p, n in zip(params, sizes, strict=True) if p.requires_grad), sum(sizes)


class ValueModel(torch.nn.Module):
    """The critic: the causal LM's transformer body with a scalar head (initialised to 0) on every position."""

    def __init__(self, path: str | Path, dtype: str = "float32", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(str(path), dtype=TORCH_DTYPES[dtype]).train()
        if gradient_checkpointing:
            self.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.value_head = torch.nn.Linear(self.body.config.hidden_size, 1, dtype=TORCH_DTYPES[dtype])
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Values ``[B, L]``; with ``attention_mask=None`` and restarting ``position_ids``, rows packed in one."""
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        values: torch.Tensor = self.value_head(hidden).squeeze(-1).float()
        return values

    def response_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        packed: bool = False,
        forward: Any = None,
    ) -> torch.Tensor:
        """V of the state before each response token, ``[B, R]`` (0 on padding). ``forward``: the callable to run
        (the DeepSpeed engine wrapping this module), default this module."""
        forward = forward or self
        if packed:
            layout = pack(input_ids, attention_mask, response_length)
            values = forward(layout.ids, None, layout.positions)[0, layout.predicts]
            return layout.unpack(values, input_ids.shape[0], response_length)
        values = forward(  # the last position's value is never used: the model runs on [B, P+R-1]
            input_ids[:, :-1], attention_mask[:, :-1], position_ids(attention_mask)[:, :-1]
        )
        response_values: torch.Tensor = values[:, -response_length:] * attention_mask[:, -response_length:]
        return response_values


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each sequence's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


RECOMPILE_LIMIT = 64
"""Graphs ``torch.compile`` may build for a model's forward: dynamo's ``recompile_limit``, counted per code object, so
every instance of the model class and every compiled use of it (the training passes' graphs, one per decode shape)
share it. torch's default, 8, is used up by a run's decode shapes beside the training graphs, and past it a
``fullgraph`` compile fails; compiling a forward here raises the limit to this at least
(:data:`~rlprof_train.workers.rollout.static_decode.MAX_SHAPES` keeps the decode under it)."""


class CompiledForward:
    """``module``'s forward compiled (``torch.compile``'s keywords in ``options``), called as the module is (keyword
    arguments; its output). The forward, not the call: hooks on the module itself (a DeepSpeed engine's timers) stay
    out of the graph; the engine's backward and step are unchanged. The training passes (``model.torch_compile``) use
    the default, dynamic shapes: the packed length and the micro-batch's width change from call to call and share a
    graph; the compiled decode uses static ones (:mod:`~rlprof_train.workers.rollout.static_decode`)."""

    def __init__(self, module: Any, **options: Any) -> None:
        self.module = module
        self.forward: Callable[..., Any] = torch.compile(module.forward, **{"dynamic": True, **options})
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)

    def __call__(self, **inputs: Any) -> Any:
        return self.forward(**inputs)


def keeps_logits(model: Any) -> bool:
    """Whether ``model`` (or the module a DeepSpeed engine wraps) takes ``logits_to_keep``."""
    module_type = type(getattr(model, "module", model))
    if module_type not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[module_type] = "logits_to_keep" in inspect.signature(module_type.forward).parameters
    return _KEEPS_LOGITS[module_type]


_KEEPS_LOGITS: dict[type, bool] = {}  # per model class: inspecting a signature costs more than a small forward


def response_log_probs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunked_entropy: bool = False,
    checkpoint_entropy: bool = False,
    entropy_grad: bool = True,
    packed: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs ``[B, R]`` of the last ``response_length`` tokens of ``input_ids`` under ``model`` at
    ``temperature`` (the rollout's, so they match the sampling distribution), and their entropies when asked.

    ``packed`` (``use_remove_padding``) runs the model on the real tokens only, all rows in one packed sequence,
    and computes the head only where a response token is predicted; the padded path runs on ``[B, P+R-1]`` (not on
    the last position, which predicts nothing and, under causal attention, changes no earlier one) and, where the
    model takes ``logits_to_keep`` (transformers' causal LMs do), computes the head on the R positions that predict
    the response only (the prompt's logits are never used).
    ``chunked_entropy`` computes entropies a chunk of positions at a time; ``checkpoint_entropy`` recomputes the
    entropy's softmax in backward instead of keeping it; ``entropy_grad=False`` computes it outside autograd (for a
    metric only). Padding positions are 0 in both outputs.
    """
    if packed:
        layout = pack(input_ids, attention_mask, response_length)
        logits = model(input_ids=layout.ids, position_ids=layout.positions, use_cache=False).logits[0]
        logits = logits[layout.predicts].float() / max(temperature, 1e-6)  # [N, V]
        targets = layout.ids[0, layout.predicts + 1]
    else:
        keep = {"logits_to_keep": response_length} if keeps_logits(model) else {}
        logits = model(  # the last position predicts nothing: the model runs on [B, P+R-1]
            input_ids=input_ids[:, :-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids(attention_mask)[:, :-1],
            use_cache=False,
            **keep,
        ).logits
        logits = logits[:, -response_length:].float() / max(temperature, 1e-6)  # [B, R, V]
        targets = input_ids[:, -response_length:]
    log_probs = torch.gather(F.log_softmax(logits, dim=-1), -1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy_fn = algos.entropy_from_logits_chunked if chunked_entropy else algos.entropy_from_logits
        if checkpoint_entropy and entropy_grad and logits.requires_grad:
            from torch.utils.checkpoint import checkpoint

            entropy = checkpoint(entropy_fn, logits, use_reentrant=False)
        else:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_fn(logits)
    if packed:
        batch = input_ids.shape[0]
        log_probs = layout.unpack(log_probs, batch, response_length)
        entropy = layout.unpack(entropy, batch, response_length) if entropy is not None else None
    else:
        response_mask = attention_mask[:, -response_length:]
        log_probs = log_probs * response_mask
        entropy = entropy * response_mask if entropy is not None else None
    return log_probs, entropy
