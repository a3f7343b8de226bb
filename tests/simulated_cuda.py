"""A CUDA device simulated on the CPU: host/device mixing caught on machines without a GPU.

On a CPU, the host and "the device" are the same place, so code that forgets to move a tensor runs anyway and fails
only on a GPU (``Expected all tensors to be on the same device``). Under :class:`SimulatedCuda`, a tensor made or
moved to ``cuda`` (``device="cuda"``, ``.to("cuda")``, ``.cuda()``, ``Module.to("cuda")``) is a CPU tensor of class
:class:`OnDevice`, whose ``.device`` says ``cuda:0``; the arithmetic is real (values, ``.item()``, autograd), only the
placement is simulated. Every torch call is checked against what CUDA allows, and :class:`DeviceMismatch` is raised
where CUDA would raise:

- an operation whose tensors are on both sides fails, except with host scalars (0-dim host tensors mix with device
  tensors in torch's element-wise operations);
- indexing a device tensor with host indices works (torch moves them); indexing a host tensor with device indices,
  or writing device values into a host tensor through an index tensor (or host values into a device one), fails;
- ``copy_`` and plain slice assignment copy across; ``.to``, ``.cuda()`` and ``.cpu()`` move;
- ``.numpy()`` of a device tensor fails;
- a random generator made for ``cuda`` (``torch.Generator(device="cuda")``) is a CPU generator standing for one
  (:class:`SimulatedGenerator`: its draws are the CPU's); drawing into a tensor with a generator of the other side
  fails, as CUDA's "Expected a 'cuda' device type for generator".

What a call returns is on the device when one of its tensors was (or its ``device=`` said ``cuda``). Gradients are
made by autograd's engine, below the level this mode sees: a parameter's gradient is put on its side by a hook.
A hardware boundary simulated, not the hardware: CUDA-only APIs (``torch.cuda.*``, streams, the allocator) are not
emulated, and kernels run on the CPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.utils.checkpoint as checkpoint_module
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten, tree_map

SIMULATED = torch.device("cuda", 0)


class DeviceMismatch(RuntimeError):
    """A host tensor met a device tensor where CUDA would raise."""


class OnDevice(torch.Tensor):
    """A CPU tensor that stands for one on ``cuda:0``."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # the mode does the bookkeeping

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return SIMULATED

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True


class OnDeviceParameter(OnDevice, torch.nn.Parameter):
    """A parameter moved to the device in place (``Module.to`` keeps the parameter objects an optimizer holds)."""


def on_device(value: Any) -> bool:
    return isinstance(value, OnDevice)


def _is_cuda(device: Any) -> Optional[bool]:
    """Whether a ``device`` argument names the device (None: it names no device)."""
    if device is None:
        return None
    if isinstance(device, int):
        return True  # torch reads a bare index as a CUDA device
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return None


def _to_device(tensor: torch.Tensor, fresh: bool) -> torch.Tensor:
    """``tensor`` on the device: its own object re-classed where nobody else holds it (``fresh``: a call's new
    result, whose saved-for-backward twin is then the same object, as a checkpoint's recomputation checks), else an
    alias; a parameter in place (the objects optimizers and hooks hold stay valid)."""
    if on_device(tensor):
        return tensor
    if isinstance(tensor, torch.nn.Parameter):
        tensor.__class__ = OnDeviceParameter
        if tensor.requires_grad:
            tensor.register_post_accumulate_grad_hook(_grad_to_device)
        return tensor
    if not fresh:
        with torch._C.DisableTorchFunction():
            tensor = tensor.view_as(tensor)
    tensor.__class__ = OnDevice
    return tensor


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if on_device(tensor) else tensor


def _grad_to_device(parameter: torch.Tensor) -> None:
    if parameter.grad is not None and not on_device(parameter.grad):
        parameter.grad.__class__ = OnDevice


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _mixes(tensors: list[torch.Tensor]) -> bool:
    """Device tensors and host tensors that are not scalars together."""
    return any(on_device(t) for t in tensors) and any(not on_device(t) and t.dim() > 0 for t in tensors)


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{'cuda' if on_device(t) else 'cpu'} {tuple(t.shape)}" for t in tensors)


class SimulatedGenerator(torch.Generator):
    """``torch.Generator`` while the mode is on: one made for ``cuda`` is a CPU generator marked as the device's."""

    on_device: bool

    def __new__(cls, device: Any = "cpu") -> SimulatedGenerator:
        generator = super().__new__(cls, "cpu")
        generator.on_device = bool(_is_cuda(device))
        return generator

    def __init__(self, device: Any = "cpu") -> None:
        pass


class SimulatedCuda(TorchFunctionMode):
    """``with SimulatedCuda():`` every torch call in the block is checked as CUDA would (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._depth = 0
        self._saved: Any = None

    def __enter__(self) -> SimulatedCuda:
        """Three adjustments while the mode is on: a checkpoint's recomputation is checked against the forward by
        shape and dtype only (the tensors it saves are made below this mode, on the real device); transformers'
        ``from_pretrained`` runs outside the mode (its meta-device initialisation, a function mode of its own, does
        not compose with this one: buffers came out uninitialised). Without ``device_map`` it returns a model on the
        host either way; moving it is what is checked. ``torch.Generator`` is :class:`SimulatedGenerator`."""
        if self._depth == 0:
            from transformers import PreTrainedModel

            checks = checkpoint_module._allowed_determinism_checks_to_fns
            self._saved = (
                checks[checkpoint_module._DEFAULT_DETERMINISM_MODE],
                PreTrainedModel.__dict__["from_pretrained"],
                torch.Generator,
            )
            torch.Generator = SimulatedGenerator  # type: ignore[misc]
            checks[checkpoint_module._DEFAULT_DETERMINISM_MODE] = lambda x: {"shape": x.shape, "dtype": x.dtype}
            load = self._saved[1].__func__

            def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
                with torch.overrides._pop_mode_temporarily():
                    return load(cls, *args, **kwargs)

            PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            from transformers import PreTrainedModel

            checks = checkpoint_module._allowed_determinism_checks_to_fns
            checks[checkpoint_module._DEFAULT_DETERMINISM_MODE], PreTrainedModel.from_pretrained, torch.Generator = (
                self._saved
            )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._move(args, kwargs)
        if func is torch.Tensor.cuda:
            return _to_device(args[0], fresh=False)
        if func is torch.Tensor.cpu:
            return _to_host(args[0])
        if func is torch.Tensor.numpy and on_device(args[0]):
            raise DeviceMismatch("numpy() of a cuda tensor: move it to the host first (Tensor.cpu())")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            self._check_indexing(func, args)
        elif isinstance(kwargs.get("generator"), torch.Generator) and args and isinstance(args[0], torch.Tensor):
            generator_on_device = getattr(kwargs["generator"], "on_device", False)
            if generator_on_device != on_device(args[0]):
                raise DeviceMismatch(
                    f"{resolve_name(func) or func}: a {'cuda' if generator_on_device else 'cpu'} generator drawing "
                    f"into a {'cuda' if on_device(args[0]) else 'cpu'} tensor"
                )
        elif func is not torch.Tensor.copy_:
            tensors = _tensors((args, kwargs))
            if _mixes(tensors):
                raise DeviceMismatch(
                    f"{resolve_name(func) or func}: expected all tensors on one device, got {_describe(tensors)}"
                )
        target = _is_cuda(kwargs.get("device"))
        if target is not None:
            kwargs = {**kwargs, "device": "cpu"}
        wanted = target if target is not None else any(on_device(t) for t in _tensors((args, kwargs)))
        inputs = {id(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        if not wanted:
            return out
        fresh = [t for t in _tensors(out) if id(t) not in inputs]
        return tree_map(lambda t: _to_device(t, fresh=True) if any(t is f for f in fresh) else t, out)

    def _backward(
        self,
        tensor: torch.Tensor,
        gradient: Optional[torch.Tensor] = None,
        retain_graph: Optional[bool] = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """``tensor.backward(...)`` with this mode kept on: torch calls a function with its mode popped, so what runs
        in backward (a checkpoint's recomputation) would not be checked. The engine is run directly, as
        ``torch.autograd.backward`` runs it."""
        if gradient is None:
            gradient = torch.ones_like(tensor)
        with self:
            torch.autograd.graph._engine_run_backward(
                (tensor,),
                (gradient,),
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                tuple(inputs) if inputs is not None else (),
                allow_unreachable=True,
                accumulate_grad=True,
            )

    @staticmethod
    def _check_indexing(func: Any, args: tuple) -> None:
        """``t[index]`` and ``t[index] = value``: host indices into a device tensor are allowed, not the reverse; a
        value written through index tensors must be on the target's side (a scalar excepted)."""
        target, index = args[0], args[1]
        indices = _tensors(index)
        if not on_device(target) and any(on_device(i) for i in indices):
            raise DeviceMismatch(f"indexing a cpu tensor {tuple(target.shape)} with cuda indices")
        if func is torch.Tensor.__setitem__ and isinstance(args[2], torch.Tensor):
            value = args[2]
            if indices and value.dim() > 0 and on_device(value) != on_device(target):
                raise DeviceMismatch(
                    f"index_put_: values on {'cuda' if on_device(value) else 'cpu'} into a "
                    f"{'cuda' if on_device(target) else 'cpu'} tensor {tuple(target.shape)}"
                )

    @staticmethod
    def _move(args: tuple, kwargs: dict) -> Any:
        """``Tensor.to(...)``: by device (``to("cuda")``, ``to(device=...)``, ``to(other_tensor)``) or dtype only."""
        tensor, rest = args[0], list(args[1:])
        target = _is_cuda(kwargs.get("device"))
        if target is not None:
            kwargs = {**kwargs, "device": "cpu"}
        for i, arg in enumerate(rest):
            if isinstance(arg, torch.Tensor):  # to(other): other's device and dtype
                target, rest[i] = on_device(arg), arg.dtype
            elif _is_cuda(arg) is not None and not isinstance(arg, bool):
                target, rest[i] = _is_cuda(arg), "cpu"
        with torch._C.DisableTorchFunction():
            out = torch.Tensor.to(tensor, *rest, **kwargs)
        if target is None:
            target = on_device(tensor)
        if target:
            return _to_device(out, fresh=out is not tensor)
        return out.as_subclass(torch.Tensor) if on_device(out) else out
