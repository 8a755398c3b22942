"""Cost models by name: each is one module whose :class:`~dcsched.costmodels.base.CostModel` subclass registers.

>>> from dcsched import costmodels
>>> costmodels.available()
['measured', 'analytic', 'calibrated']
>>> costmodels.get("analytic").description.split(":")[0]
"a named GPU's achievable rates from FLOPs and bytes"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from dcsched.errors import OptionError
from dcsched.costmodels.base import CostModel

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions

Model = TypeVar("Model", bound=type[CostModel])

_REGISTRY: dict[str, type[CostModel]] = {}
#: The built-in models, registered (in this order) when the registry is first used.
BUILTIN = ("measured", "analytic", "calibrated")


def _register_builtins() -> None:
    import importlib
    for module in BUILTIN:
        importlib.import_module(f"dcsched.costmodels.{module}")


def register(cls: Model) -> Model:
    """Class decorator: make ``cls`` available as ``cls.name`` (``ProfileOptions(cost_model=NAME)``)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"cost model {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> type[CostModel]:
    return _REGISTRY.pop(name)


def available() -> list[str]:
    """The registered names: the built-in models first (in :data:`BUILTIN`'s order), then the others."""
    _register_builtins()
    return [name for name in BUILTIN if name in _REGISTRY] + [name for name in _REGISTRY if name not in BUILTIN]


def get(name: str) -> type[CostModel]:
    _register_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OptionError("cost_model", f"names an unknown cost model {name!r} (choose from "
                                        f"{', '.join(available())})") from None


def build(options: ProfileOptions) -> CostModel:
    """The cost model ``options`` asks for, checked against them.

    A calibration file with the analytic model asks for the calibrated one
    (the analytic time scaled by the file's factors).
    """
    name = options.cost_model
    if options.calibration is not None and name == "analytic":
        name = "calibrated"
    cls = get(name)
    if options.calibration is not None and not cls.takes_calibration:
        raise OptionError("calibration", f"scales the analytic model; the {name} cost model takes none")
    return cls.from_options(options)
