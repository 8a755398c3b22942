"""Stage 2, the bundle: one versioned file holding a captured training step, and what a loader refuses.

:mod:`~dcsched.bundle.core` reads and writes it (the :class:`~dcsched.bundle.core.Bundle`),
:mod:`~dcsched.bundle.graph_encoding` turns a graph into plain data and back (checked),
:mod:`~dcsched.bundle.fileio` is the safetensors file (versions 2 and 3),
:mod:`~dcsched.bundle.columns` its graphs as columns (encoding, the file's parts, permutation), laid out
as :mod:`~dcsched.bundle.column_format` says, checked by :mod:`~dcsched.bundle.column_checks` and read
(graph form, FX) by :mod:`~dcsched.bundle.column_views`,
:mod:`~dcsched.bundle.plans` its communication plans (version 3: buckets, residency),
:mod:`~dcsched.bundle.legacy` version 1 (torch files), :mod:`~dcsched.bundle.checks`
holds the allow-lists a bundle is checked against before anything is built
from it, :mod:`~dcsched.bundle.summary` says what a bundle holds (``dcsched show``).
"""
