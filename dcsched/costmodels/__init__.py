"""Cost models: how a profile obtains each node's ``device_time``, one module each, registered by name.

* ``measured`` (:mod:`~dcsched.costmodels.measured`): run the step here and time every node;
* ``analytic`` (:mod:`~dcsched.costmodels.analytic`): a roofline for a named GPU, nothing runs;
* ``calibrated`` (:mod:`~dcsched.costmodels.calibrated`): the roofline times per-op-kind factors
  measured on a GPU, read from a JSON file.

Each is a :class:`~dcsched.costmodels.base.CostModel` subclass decorated with
:func:`register`; :func:`build` makes the one a
:class:`~dcsched.profile.measure.ProfileOptions` names. The formulas they share (GPU
table, roofline, communication time, FLOPs) are in
:mod:`~dcsched.costmodels.formulas`.
"""

from dcsched.costmodels.base import CostModel, ProfileRun, StaticCostModel
from dcsched.costmodels.registry import available, build, get, register, unregister

# Each import registers one model.
from dcsched.costmodels import measured  # noqa: F401
from dcsched.costmodels import analytic  # noqa: F401
from dcsched.costmodels import calibrated  # noqa: F401
from dcsched.costmodels.calibrated import Calibration, fit_calibration, load_calibration, op_kind

__all__ = ["CostModel", "ProfileRun", "StaticCostModel", "available", "build", "get", "register", "unregister",
           "Calibration", "fit_calibration", "load_calibration", "op_kind"]
