"""Cost models: how a profile obtains each node's ``device_time``, one module each, registered by name.

* ``measured`` (:mod:`~dcsched.costmodels.measured`): run the step here and time every node;
* ``analytic`` (:mod:`~dcsched.costmodels.analytic`): a roofline for a named GPU, nothing runs;
* ``calibrated`` (:mod:`~dcsched.costmodels.calibrated`): the roofline times per-op-kind factors
  measured on a GPU, read from a JSON file.

Each is a :class:`~dcsched.costmodels.base.CostModel` subclass decorated with
:func:`register`; :func:`build` makes the one a
:class:`~dcsched.profile.ProfileOptions` names. The formulas they share (GPU
table, roofline, communication time, FLOPs) are in
:mod:`~dcsched.costmodels.formulas`.
"""

from .base import CostModel, ProfileRun, StaticCostModel
from .registry import available, build, get, register, unregister

# Each import registers one model.
from . import measured  # noqa: F401
from . import analytic  # noqa: F401
from . import calibrated  # noqa: F401
from .calibrated import Calibration, fit_calibration, load_calibration, op_kind

__all__ = ["CostModel", "ProfileRun", "StaticCostModel", "available", "build", "get", "register", "unregister",
           "Calibration", "fit_calibration", "load_calibration", "op_kind"]
