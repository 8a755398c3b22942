"""What an optimizer holds per parameter shard, for the whole step's memory (:mod:`dcsched.sim.step_memory`).

An :class:`OptimizerModel` says how many state tensors ``torch.optim`` keeps
per parameter (each the shape and dtype of the parameter: ``torch.zeros_like``,
so the shard's dtype, fp32 for fp32 master weights), whether it keeps a scalar
``step`` tensor per parameter (fp32, on the CPU unless ``capturable`` or
``fused``) and what its update allocates for a moment: the single-tensor
update (what torch runs on the CPU) makes temporaries the size of one
parameter, the multi-tensor (``foreach``, torch's default on CUDA) one list of
them the size of all.

>>> named("adamw").state_tensors, named("sgd").state_tensors, named("sgd-momentum").state_tensors
(2, 0, 1)
>>> named("lamb")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
dcsched.bundle.optimizer.OptimizerError: unknown optimizer 'lamb': one of adadelta, adagrad, adam, ..., sgd-momentum
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dcsched.errors import DcschedError

#: Provenance key: the optimizer the captured script builds (:meth:`OptimizerModel.provenance`).
OPTIMIZER_KEY = "optimizer"


class OptimizerError(DcschedError, ValueError):
    """An optimizer dcsched does not model, or an optimizer record out of bounds; the message says which."""


@dataclasses.dataclass(frozen=True)
class OptimizerModel:
    """The memory an optimizer holds and allocates per parameter shard.

    ``state_tensors``: state tensors of the shard's shape and dtype per parameter (AdamW: ``exp_avg`` and
    ``exp_avg_sq``); ``step_scalar``: a 0-d fp32 ``step`` tensor per parameter (on the CPU, so counted only on
    a CPU target); ``single_temporaries``: temporaries of one parameter's size the single-tensor update holds
    at once (AdamW: ``exp_avg_sq.sqrt()`` and its quotient); ``foreach_temporaries``: lists of all the
    parameters' size the multi-tensor update holds at once (AdamW: ``_foreach_sqrt``).
    """

    name: str
    state_tensors: int
    step_scalar: bool = False
    single_temporaries: int = 0
    foreach_temporaries: int = 0

    def provenance(self) -> dict[str, Any]:
        """The bundle provenance entry that records this optimizer.

        >>> named("adamw").provenance()["state_tensors"]
        2
        """
        return dataclasses.asdict(self)


#: The optimizers dcsched models, by the name ``--optimizer`` takes (torch.optim's defaults; ``sgd-momentum``:
#: SGD with ``momentum`` > 0). Temporaries read from torch.optim's ``_single_tensor_*`` / ``_multi_tensor_*``.
KNOWN: dict[str, OptimizerModel] = {m.name: m for m in (
    OptimizerModel("adamw", 2, True, 2, 1),
    OptimizerModel("adam", 2, True, 2, 1),
    OptimizerModel("adamax", 2, True, 1, 1),
    OptimizerModel("adagrad", 1, True, 1, 1),
    OptimizerModel("rmsprop", 1, True, 1, 1),
    OptimizerModel("adadelta", 2, True, 2, 1),
    OptimizerModel("sgd", 0),
    OptimizerModel("sgd-momentum", 1),
    OptimizerModel("none", 0),
)}


def named(name: str) -> OptimizerModel:
    """The model of the optimizer ``name`` (case-insensitive; :data:`KNOWN`).

    Raises
    ------
    OptimizerError
        One line listing the known names.
    """
    model = KNOWN.get(str(name).lower())
    if model is None:
        raise OptimizerError(f"unknown optimizer {str(name)[:40]!r}: one of {', '.join(sorted(KNOWN))}")
    return model


def of_torch(optimizer: Any) -> OptimizerModel | None:
    """The model of a ``torch.optim.Optimizer`` instance, by its class and its first group's settings (None for a
    class dcsched does not model).

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> of_torch(torch.optim.SGD([p], lr=0.1, momentum=0.9)).name, of_torch(torch.optim.AdamW([p])).name
    ('sgd-momentum', 'adamw')
    """
    name = type(optimizer).__name__.lower()
    groups = getattr(optimizer, "param_groups", None) or [{}]
    group = groups[0] if isinstance(groups[0], Mapping) else {}
    if name == "sgd":
        return KNOWN["sgd-momentum" if group.get("momentum") else "sgd"]
    model = KNOWN.get(name)
    if model is None:
        return None
    extra = 0
    if name in ("adam", "adamw") and group.get("amsgrad"):
        extra = 1  # max_exp_avg_sq
    elif name == "rmsprop":
        extra = int(bool(group.get("momentum"))) + int(bool(group.get("centered")))
    return dataclasses.replace(model, state_tensors=model.state_tensors + extra) if extra else model


def from_provenance(provenance: Mapping[str, Any]) -> OptimizerModel | None:
    """The optimizer a bundle's provenance records (:data:`OPTIMIZER_KEY`), or None where it records none.

    Raises
    ------
    OptimizerError
        A record that is not a mapping of the :class:`OptimizerModel` fields in bounds.

    Examples
    --------
    >>> from_provenance({"optimizer": named("sgd").provenance()}).name
    'sgd'
    >>> from_provenance({"optimizer": {"name": "x", "state_tensors": -1}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dcsched.bundle.optimizer.OptimizerError: the bundle's provenance optimizer is not a record of ...
    """
    record = provenance.get(OPTIMIZER_KEY)
    if record is None:
        return None
    fields = {f.name: f.type for f in dataclasses.fields(OptimizerModel)}
    counts = ("state_tensors", "single_temporaries", "foreach_temporaries")
    good = isinstance(record, Mapping) and set(record) <= set(fields) and isinstance(record.get("name"), str) \
        and 0 < len(record["name"]) <= 64 and all(type(record.get(k, 0)) is int and 0 <= record.get(k, 0) <= 16
                                                  for k in counts) \
        and type(record.get("step_scalar", False)) is bool
    if not good:
        raise OptimizerError("the bundle's provenance optimizer is not a record of an optimizer's state (name, "
                             "state_tensors 0 to 16, ...)")
    return OptimizerModel(**dict(record))
