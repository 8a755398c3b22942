"""``dcsched.shard``: a module's parameters become this rank's 1-D ZeRO-3 shards, in place.

Each parameter, frozen or trainable (a tied one once, under its first name),
keeps its ``nn.Parameter`` object, so an optimizer built before or after
holds the same objects; its ``.data`` becomes this rank's slice of the
flattened parameter, zero-padded to ``ceil(numel / W)`` elements
(:func:`dcsched.runtime.distributed.shard_of`). Buffers (BatchNorm
statistics) stay whole on every rank. So do, with ``replicate_below=N`` over
more than one rank, the parameters of fewer than N elements (DeepSpeed's
``stage3_param_persistence_threshold``): their ``.data`` is the whole
flattened parameter, their :class:`ShardSpec` says ``replicated``, and the
backend runs them as the plan's ``'replicated'`` residency (no gather, the
gradient all-reduced); they keep a ds_id, a stand-in and their ZeRO-3 ops
in the captured graph, so the planner sees them.

TorchDynamo must still trace the module with full-size parameters. So each
sharded parameter gets a *stand-in*: a tensor of the full shape whose storage
holds no bytes, and the module's ``forward`` (an instance attribute set here)
runs the class's forward through :func:`torch.func.functional_call` with the
stand-ins in place of the shards. The traced graph takes the stand-ins as
inputs; :func:`dcsched.backend` recognises them by identity and substitutes
the shards at run time. Guards see the stand-ins' unchanging full shapes, so
the module compiles once.

Each parameter has two stand-ins, one requiring grad and one not, and the
forward hands the traced graph the one that matches the parameter's
``requires_grad`` when TorchDynamo traces it. TorchDynamo guards on what the
traced code read, so a parameter frozen or unfrozen after the compile (the
backbone unfrozen after N steps) makes it trace again: the new graph computes
the gradient of every parameter that now requires one, and the backend
reduce-scatters it like any other.

Compiled, a sharded module runs with ``backend=dcsched.backend(...)``
(another backend would read the stand-ins' empty storage). Called eagerly
(evaluation, ``generate``, a checkpointed layer TorchDynamo leaves to eager),
each submodule gathers its own parameters for its call
(:mod:`dcsched.train.eager`); eager code that reads a stand-in anywhere else
stops with one line naming the parameter.

>>> import torch
>>> model = torch.nn.Linear(3, 2)
>>> sharding = shard(model)
>>> [tuple(p.shape) for p in model.parameters()], [s.shape for s in sharding.specs]
([(6,), (2,)], [(2, 3), (2,)])
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
import torch.nn as nn

from dcsched.runtime.distributed import padded_numel, shard_of
from dcsched.errors import DcschedError
from dcsched.train import eager, full_state
from dcsched.train.mixed_precision import MixedPrecisionPolicy, policy_of


class ShardingError(DcschedError):
    """The module cannot be sharded or compiled as asked; the message says why."""


@dataclasses.dataclass(frozen=True, eq=False)
class ShardSpec:
    """One sharded parameter: its name, ds_id, full shape and dtype, the shard and the stand-in.

    ``replicated``: whole on every rank (``shard(..., replicate_below=N)``):
    ``param`` holds the whole flattened parameter rather than a shard.
    """

    name: str
    ds_id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: The module's own parameter object, now holding this rank's 1-D padded shard.
    param: nn.Parameter
    #: Full shape, no storage: what the traced graph takes in the parameter's place while it requires grad.
    stand_in: torch.Tensor
    replicated: bool = False
    #: The same without grad: what the traced graph takes while the parameter is frozen (None: ``stand_in``,
    #: for a parameter that cannot require grad).
    frozen_stand_in: torch.Tensor | None = None
    #: The dtype its gradient is reduced in (``mp_policy``); None: the gradient's own.
    reduce_dtype: torch.dtype | None = None

    @property
    def stand_ins(self) -> tuple[torch.Tensor, ...]:
        """Every stand-in of the parameter (what a traced graph may take in its place)."""
        return (self.stand_in,) if self.frozen_stand_in is None else (self.stand_in, self.frozen_stand_in)

    def traced_stand_in(self) -> torch.Tensor:
        """The stand-in matching the parameter's ``requires_grad`` now (read under tracing: guarded)."""
        if self.frozen_stand_in is None or self.param.requires_grad:
            return self.stand_in
        return self.frozen_stand_in

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype it is gathered and computed in: its stand-in's (``dtype`` under no ``mp_policy``)."""
        return self.stand_in.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(eq=False)
class Sharding:
    """How one module is sharded over ``world_size`` ranks (``group``: the process group, None = default)."""

    module: nn.Module
    specs: list[ShardSpec]
    rank: int
    world_size: int
    group: object = None
    #: The mixed-precision policy it gathers, computes and reduces under (None: each parameter's own dtype).
    mp_policy: MixedPrecisionPolicy | None = None

    def spec_of_stand_in(self, tensor) -> ShardSpec | None:
        return self._by_stand_in.get(id(tensor))

    def __post_init__(self) -> None:
        self._by_stand_in = {id(stand_in): spec for spec in self.specs for stand_in in spec.stand_ins}
        self._paths = [(spec.name.split(".")[:-1], spec.name.rpartition(".")[2], spec) for spec in self.specs]

    def check_intact(self) -> None:
        """Raise :class:`ShardingError` if a sharded parameter is no longer where :func:`shard` found it.

        A submodule replaced after the compile (``model.fc = nn.Linear(...)``) would otherwise be ignored: the
        scheduled graphs train the parameters that were sharded.
        """
        for parts, leaf, spec in self._paths:
            module = self.module
            for part in parts:
                module = module._modules.get(part) if module is not None else None
            found = module._parameters.get(leaf) if module is not None else None
            # The stand-in is there while the forward runs (functional_call swaps it in; a graph break runs
            # this step inside that swap).
            if found is not spec.param and not any(found is stand_in for stand_in in spec.stand_ins):
                raise ShardingError(f"{type(self.module).__name__}.{spec.name} was replaced after dcsched.shard: "
                                    "the compiled step trains the parameters it sharded; change the module "
                                    "before torch.compile, or shard and compile the changed module anew")

    def shard_numel(self, spec: ShardSpec) -> int:
        """Elements ``spec``'s parameter holds on this rank (the whole for a replicated one)."""
        return spec.numel if spec.replicated else padded_numel(spec.numel, self.world_size) // self.world_size

    @property
    def replicated(self) -> frozenset[int]:
        """The ds_ids of the parameters whole on every rank (``replicate_below``)."""
        return frozenset(spec.ds_id for spec in self.specs if spec.replicated)


#: The module attribute holding its Sharding.
ATTRIBUTE = "dcsched_sharding"
# id(stand-in) -> Sharding, to find the module from a traced graph's inputs.
_BY_STAND_IN: "weakref.WeakValueDictionary[int, Sharding]" = weakref.WeakValueDictionary()


def sharding_of(module: nn.Module) -> Sharding | None:
    """The :class:`Sharding` :func:`shard` gave ``module``, if any."""
    found = module.__dict__.get(ATTRIBUTE)
    return found if isinstance(found, Sharding) else None


def sharding_for_inputs(inputs) -> Sharding | None:
    """The sharding whose stand-ins appear among a traced graph's ``inputs``, if any."""
    for value in inputs:
        found = _BY_STAND_IN.get(id(value)) if isinstance(value, torch.Tensor) else None
        if found is not None and found.spec_of_stand_in(value) is not None:
            return found
    return None


def _process_group(group) -> tuple[int, int]:
    """(rank, ranks) of the group the module is sharded over: where training's world size is decided (the
    compile's profile topology takes ``Sharding.world_size``)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class _ClassForward(nn.Module):
    """Holds the module and runs its class's forward (not the instance override), so functional_call can."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return type(self.inner).forward(self.inner, *args, **kwargs)


def _install_forward(module: nn.Module, specs: list[ShardSpec], policy: MixedPrecisionPolicy | None) -> None:
    holder = _ClassForward(module)
    keys = [(f"inner.{spec.name}", spec) for spec in specs]
    own = [(f"inner.{spec.name}", spec) for spec in specs if "." not in spec.name]  # the module's own

    def forward(*args, **kwargs):
        if policy is None:
            return _forward(args, kwargs)
        # traced too when compiling: the graph takes the inputs as given and casts them itself
        args, kwargs = policy.cast_inputs(args, kwargs)
        return policy.cast_output(_forward(args, kwargs))

    def _forward(args, kwargs):
        # Reading each parameter's requires_grad here makes TorchDynamo guard on it: freezing or unfreezing one
        # after the compile traces the step again, with the gradients it now needs.
        stand_ins = {key: spec.traced_stand_in() for key, spec in keys}
        if torch.compiler.is_compiling():
            return torch.func.functional_call(holder, stand_ins, args, kwargs)
        # Eagerly, the module's own parameters were gathered by its pre-hook (dcsched.train.eager): those stay;
        # every other one is its stand-in until its own module's call gathers it.
        for key, spec in own:
            if module._parameters.get(spec.name) is not spec.param:
                del stand_ins[key]
        return torch.func.functional_call(holder, stand_ins, args, kwargs)

    module.forward = forward


def shard(module: nn.Module, group=None, replicate_below: int = 0, mp_policy=None) -> Sharding:
    """Shard ``module``'s parameters over ``group`` (default: the default process group) in place.

    Frozen parameters are sharded too, so one unfrozen after the compile
    trains like the others (see the module docstring).

    Call it before the optimizer takes its first step (the optimizer then sees
    the shards, whether it was built before or after). Without a process
    group the world size is 1 and each shard is the whole flattened
    parameter. Sharding a module twice returns the first sharding.

    Parameters
    ----------
    module : torch.nn.Module
        The module whose parameters become this rank's 1-D shards (a tied parameter once).
    group : torch.distributed.ProcessGroup, optional
        The ranks to shard over; by default the default process group, or none (world size 1).
    replicate_below : int, optional
        Over more than one rank, a parameter of fewer elements stays whole (flattened) on every
        rank: no all-gather, its gradient all-reduced (the plan's ``'replicated'`` residency), as DeepSpeed's
        ``stage3_param_persistence_threshold`` keeps small parameters. Default 0: every one sharded.
    mp_policy : MixedPrecisionPolicy, optional
        Mixed precision as FSDP2's ``mp_policy`` (:mod:`dcsched.train.mixed_precision`; its
        ``torch.distributed.fsdp.MixedPrecisionPolicy`` is taken too): the shards keep their dtype (the
        optimizer's master weights), gathers and compute run in ``param_dtype``, gradients are reduced in
        ``reduce_dtype`` and land in the shard's dtype. Default: none (every parameter in its own dtype).

    Returns
    -------
    Sharding
        What was sharded: one :class:`ShardSpec` per parameter, the rank and the world size.

    Raises
    ------
    ShardingError
        Not a module, a module compiled already (an instance-level ``forward``), one with no trainable
        parameter, or a negative ``replicate_below``.
    MixedPrecisionError
        ``mp_policy`` is no policy, or names a dtype that is not floating.

    Examples
    --------
    >>> import torch, dcsched
    >>> model = torch.nn.Linear(4, 2)
    >>> sharding = dcsched.shard(model, replicate_below=3)
    >>> sharding.world_size, [tuple(p.shape) for p in model.parameters()], sorted(sharding.replicated)
    (1, [(8,), (2,)], [])
    """
    if not isinstance(module, nn.Module):
        raise ShardingError(f"dcsched.shard takes an nn.Module, not {type(module).__name__}")
    if isinstance(replicate_below, bool) or not isinstance(replicate_below, int) or replicate_below < 0:
        raise ShardingError(f"replicate_below must be a whole number of elements, 0 or more, not {replicate_below!r}")
    policy = policy_of(mp_policy)
    existing = sharding_of(module)
    if existing is not None:
        if policy is not None and policy != existing.mp_policy:
            raise ShardingError(f"{type(module).__name__} is sharded already under mp_policy={existing.mp_policy}; "
                                f"it cannot be sharded again under {policy}")
        return existing
    if "forward" in module.__dict__:
        raise ShardingError(f"{type(module).__name__} has an instance-level forward (compiled already?): shard "
                            "the module itself, before torch.compile")
    rank, world_size = _process_group(group)
    specs: list[ShardSpec] = []
    if not any(param.requires_grad for param in module.parameters()):
        raise ShardingError(f"{type(module).__name__} has no trainable parameters to shard")
    for name, param in module.named_parameters():  # a tied parameter once, under its first name
        full = param.detach()
        shape = tuple(full.shape)
        # At world size 1 every shard is whole already: nothing to replicate, the plans stay as they were.
        whole = world_size > 1 and full.numel() < replicate_below
        trainable = full.is_floating_point() or full.is_complex()  # an integer parameter never requires grad
        # the traced graph takes the stand-in: of the gathered dtype, so it computes in it
        compute = policy.gather_dtype(full.dtype) if policy is not None and full.is_floating_point() else full.dtype
        stand_in = eager.stand_in(shape, compute, full.device, requires_grad=trainable)
        frozen = eager.stand_in(shape, compute, full.device, requires_grad=False) if trainable else None
        reduce_dtype = policy.reduce_dtype_for(full.dtype) if policy is not None and full.is_floating_point() \
            else None
        grad, param.grad = param.grad, None  # a gradient accumulated eagerly before: sharded alike
        with torch.no_grad():
            param.data = full.reshape(-1).clone() if whole else shard_of(full, rank, world_size)
            if grad is not None:
                param.grad = grad.reshape(-1).clone() if whole else shard_of(grad, rank, world_size)
        specs.append(ShardSpec(name, len(specs), shape, full.dtype, param, stand_in, whole,
                               frozen_stand_in=frozen, reduce_dtype=reduce_dtype))
    sharding = Sharding(module, specs, rank, world_size, group, policy)
    _install_forward(module, specs, policy)
    module.__dict__[ATTRIBUTE] = sharding
    full_state.install(sharding)  # full weights in state_dict(), the global norm in clip_grad_norm_
    eager.install(sharding)  # eager module calls gather their own parameters
    for spec in specs:
        for stand_in in spec.stand_ins:
            _BY_STAND_IN[id(stand_in)] = sharding
    return sharding
