"""Capture without the weights (``profile --meta``): the script's tensors on the meta device, traced as another's.

Under ``--meta`` a script runs with the meta device as its default
(:func:`planning_device`), so its model and inputs hold shapes and dtypes but
no storage; while TorchDynamo and AOT autograd trace, its meta tensors claim a
real device (:func:`meta_claims`), so the graphs are those of a run there; the
compiled graphs then run on the meta device (:func:`on_meta`).

Split from :mod:`dcsched.profile.capture`, as the project keeps a module to
one job and about 600 lines.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from dcsched.runtime.step import on_device

CPU = torch.device("cpu")
META = torch.device("meta")


@contextlib.contextmanager
def meta_claims(device: torch.device):
    """While open, a meta tensor made fake (TorchDynamo's and AOT autograd's tracing) claims ``device``.

    A fake tensor is a meta tensor that says which device it is on; TorchDynamo and AOT autograd trace
    with fake copies of the script's tensors, so with its meta tensors claiming ``device`` the graphs are
    those of a run on ``device``, from tensors that hold no data. Traced as meta tensors they were not:

    * the model's Python code tests the device before any tracing (Mixtral's auxiliary loss: ``histc`` in
      float32 on the CPU, int32 elsewhere; transformers' grouped-mm choice);
    * kernels choose by device: ``scaled_dot_product_attention`` takes the CPU's flash kernel on the CPU
      and the math path (the scores a tensor of the graph) on meta;
    * torch's Python dispatcher, on during AOT autograd's tracing, sends a composite op that has a Python
      meta kernel (``aten.nll_loss``: ``cross_entropy``) on a meta tensor to that kernel, below autograd, so
      the joint graph had no gradient of the loss (``nll_loss_backward``) and the partitioner saved other
      tensors for the backward.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter

    real_from_real_tensor = FakeTensorConverter.from_real_tensor

    class Claiming:
        def __init__(self, converter):
            self.converter = converter

        def __getattr__(self, name):
            return getattr(self.converter, name)

        def __call__(self, t, *args, callback, **kwargs):
            def claim(make_meta, **more):
                if torch.device(more.get("device", "meta")).type == "meta":
                    more["device"] = device
                return callback(make_meta, **more)
            return self.converter(t, *args, callback=claim, **kwargs)

    def from_real_tensor(self, fake_mode, t, *args, **kwargs):
        if isinstance(t, FakeTensor) or not (isinstance(t, torch.Tensor) and t.is_meta):
            return real_from_real_tensor(self, fake_mode, t, *args, **kwargs)
        converter = self.meta_converter
        self.meta_converter = Claiming(converter)
        try:
            return real_from_real_tensor(self, fake_mode, t, *args, **kwargs)
        finally:
            self.meta_converter = converter

    FakeTensorConverter.from_real_tensor = from_real_tensor
    try:
        yield
    finally:
        FakeTensorConverter.from_real_tensor = real_from_real_tensor


#: The tensor methods that move a tensor to a device (``Module.to``, ``.cuda()`` and ``.cpu()`` call them on
#: each parameter and buffer).
_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


def _moves_a_meta_tensor(args: tuple) -> bool:
    """Whether a move's tensor is one of the script's meta tensors (not a fake tensor TorchDynamo traces)."""
    from torch._subclasses.fake_tensor import FakeTensor
    tensor = args[0] if args else None
    return (isinstance(tensor, torch.Tensor) and tensor.is_meta and not isinstance(tensor, FakeTensor)
            and not torch.compiler.is_compiling())


def _kept_on_meta(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """A move of a meta tensor that keeps it on the meta device: ``.to``'s dtype and memory format still apply.

    A script planned under ``--meta`` moves its model and batches where a real run would
    (``model.to(device)``, ``batch.cuda()``); the meta tensors have no data to copy there, so they stay
    meta, of the dtype the move asks for (``.to(other)`` takes ``other``'s).

    >>> with planning_device(CPU):
    ...     moved = torch.nn.Linear(2, 2).to("cpu", torch.float16)
    ...     moved.weight.device, moved.weight.dtype, torch.ones(2).cpu().is_meta
    (device(type='meta'), torch.float16, True)
    """
    tensor, rest = args[0], list(args[1:])
    if func is not torch.Tensor.to:  # .cuda(device), .cpu(): nothing but the device
        return tensor
    if rest and isinstance(rest[0], torch.Tensor):
        rest[0] = rest[0].dtype  # to(other, ...) is to(other.dtype, ...) on meta
    elif rest and not isinstance(rest[0], torch.dtype):
        rest[0] = META  # to(device, ...): a str, torch.device or a CUDA index
    if "device" in kwargs:
        kwargs = {**kwargs, "device": META}
    return func(tensor, *rest, **kwargs)


def planning_device(traced_as: torch.device):
    """The script's default device under ``--meta``: meta when it runs, ``traced_as`` where TorchDynamo traces.

    A tensor the compiled code makes without naming a device (``torch.ones(n)``) is then made on the device
    the traced inputs claim (see :func:`meta_claims`), as in a run there; the script itself, outside the
    compiled module, makes its model and inputs on the meta device.
    """
    from torch.utils._device import DeviceContext, _device_constructors

    class PlanningDevice(DeviceContext):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _device_constructors() and kwargs.get("device") is None:
                kwargs["device"] = traced_as if torch.compiler.is_compiling() else self.device
            elif func in _MOVES and _moves_a_meta_tensor(args):
                return _kept_on_meta(func, args, kwargs)
            return func(*args, **kwargs)

    return PlanningDevice(META)


def on_meta(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that runs on meta tensors (the devices it names and its constants on meta)."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = on_device(node.args, META), on_device(node.kwargs, META)
    runnable = torch.fx.GraphModule(gm, graph)
    for node in graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            module = runnable.get_submodule(owner) if owner else runnable
            value = getattr(module, name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                with unset_fake_temporarily():  # compiled while AOT autograd traces
                    setattr(module, name, value.to(META))
    return runnable

