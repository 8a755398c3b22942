"""Stage 1, profile: run a script or a module, capture its forward and backward graphs, insert the ZeRO-3 ops, measure.

:mod:`~dcsched.profile.scripts` runs a user's script with ``torch.compile``
intercepted, :mod:`~dcsched.profile.capture` captures the step (its TorchDynamo backend in
:mod:`~dcsched.profile.recording`, the bundle built in :mod:`~dcsched.profile.assemble`, capture on the
meta device in :mod:`~dcsched.profile.meta_device`),
:mod:`~dcsched.profile.zero3` inserts the ZeRO-3 ops and
:mod:`~dcsched.profile.measure` fills in each node's ``device_time`` and
``tensor_size`` with a cost model (:mod:`dcsched.costmodels`).
"""
