"""The scheduling algorithms, one module each, registered by name.

Importing this package registers every built-in scheduler; see
:mod:`dcsched.schedulers.registry` for the contract. :func:`run` is the one
way to call one: a :class:`~dcsched.graph.form.GraphForm` and a
:class:`~dcsched.budget.Budget` in, a :class:`Plan` out.
"""

from dcsched.plan import Bucket, Plan
from dcsched.schedulers.registry import SchedulerInfo, available, check_budget_taken, get, register, run, run_step

# Each import registers one algorithm.
from dcsched.schedulers import none  # noqa: F401
from dcsched.schedulers import list_order  # noqa: F401
from dcsched.schedulers import simple_prefetch  # noqa: F401
from dcsched.schedulers import fast_free  # noqa: F401
from dcsched.schedulers import overlap, ahead  # noqa: F401
from dcsched.schedulers import deepcompile  # noqa: F401
from dcsched.schedulers import fsdp  # noqa: F401
from dcsched.schedulers import overlap_plan  # noqa: F401

__all__ = ["Bucket", "Plan", "SchedulerInfo", "available", "check_budget_taken", "get", "register", "run",
           "run_step"]
