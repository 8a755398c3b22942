"""dcsched's command line: ``dcsched show|profile|schedule|replay``."""

from .app import app, main, run
from . import show  # noqa: F401  (each module registers its command)

__all__ = ["app", "main", "run"]
