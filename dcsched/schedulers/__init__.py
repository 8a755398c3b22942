"""The scheduling algorithms, one module each, registered by name.

Importing this package registers every built-in scheduler; see
:mod:`dcsched.schedulers.registry` for the contract.
"""

from .registry import SchedulerInfo, available, get, register

# Each import registers one algorithm.
from . import none  # noqa: F401

__all__ = ["SchedulerInfo", "available", "get", "register"]
