"""Stage 2, the bundle: one versioned file holding a captured training step, and what a loader refuses.

:mod:`~dcsched.bundle.core` reads and writes it, :mod:`~dcsched.bundle.checks`
holds the allow-lists a bundle is checked against before anything is built
from it, :mod:`~dcsched.bundle.summary` says what a bundle holds (``dcsched show``).
"""
