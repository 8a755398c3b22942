"""Cost models: how a profile obtains each node's ``device_time``, one module each, registered by name.

* ``measured`` (:mod:`~dcsched.costmodels.measured`): run the step here and time every node;
* ``analytic`` (:mod:`~dcsched.costmodels.analytic`): a named GPU's achievable rates from FLOPs and bytes (published
  fractions of its peaks, :mod:`~dcsched.costmodels.achievable`), nothing runs;
* ``calibrated`` (:mod:`~dcsched.costmodels.calibrated`): the analytic time times per-op-kind factors
  measured on a GPU, read from a JSON file.

Every model costs a modelled all-gather or reduce-scatter at the run's world
size with the latency and bus bandwidth of the target GPU kind's interconnect
(:func:`interconnect`, the table in :mod:`~dcsched.costmodels.interconnects`),
unless the options give them; world size, ranks per node and link are one
:class:`Topology` (:mod:`~dcsched.costmodels.topology`), resolved where the run
starts.

Each is a :class:`~dcsched.costmodels.base.CostModel` subclass decorated with
:func:`register`; :func:`build` makes the one a
:class:`~dcsched.costmodels.options.ProfileOptions` names. The formulas they share (GPU
table, roofline, communication time, FLOPs) are in
:mod:`~dcsched.costmodels.formulas`.

The names below are imported on first use, so that
:mod:`dcsched.costmodels.options` (which the command line reads its defaults
from) can be imported without torch. The built-in models register when the
registry is first asked for one.
"""

from __future__ import annotations

from dcsched.lazy import lazy_names

#: Public name -> the module (in this package) that defines it.
_LAZY = {
    "CostModel": "base", "ProfileRun": "base", "StaticCostModel": "base",
    "available": "registry", "build": "registry", "get": "registry", "register": "registry",
    "unregister": "registry",
    "Calibration": "calibrated", "fit_calibration": "calibrated", "load_calibration": "calibrated",
    "op_kind": "calibrated",
    "ProfileOptions": "options",
    "interconnect": "interconnects", "Link": "interconnects", "INTERCONNECTS": "interconnects",
    "Topology": "topology", "resolve_topology": "topology",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


__all__ = ["CostModel", "ProfileRun", "StaticCostModel", "available", "build", "get", "register", "unregister",
           "Calibration", "fit_calibration", "load_calibration", "op_kind", "ProfileOptions",
           "interconnect", "Link", "INTERCONNECTS", "Topology", "resolve_topology"]
