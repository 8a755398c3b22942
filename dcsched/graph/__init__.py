"""Graphs: the integer-indexed form the schedulers and simulator share, the networkx view, node roles and sizes.

Everything downstream of a capture reads a graph through these modules:
:mod:`~dcsched.graph.form` (:class:`~dcsched.graph.form.GraphForm`),
:mod:`~dcsched.graph.nxview` (networkx view and the way back to FX),
:mod:`~dcsched.graph.fxbuild`, :mod:`~dcsched.graph.roles`,
:mod:`~dcsched.graph.specs` and :mod:`~dcsched.graph.lastuse`.
"""
