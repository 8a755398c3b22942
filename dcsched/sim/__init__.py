"""The simulator: memory over time and the two-stream step time of one order, with its lower bounds.

:mod:`~dcsched.sim.simulate` runs an order, :mod:`~dcsched.sim.result` holds
what a run gives, :mod:`~dcsched.sim.bounds` the order-independent lower bounds.
"""
