"""dcsched's command line: ``dcsched profile|show|schedule|replay|train|convert``."""

from dcsched.cli.app import app, main, run

# Each module registers its command; the import order is the order --help lists them.
from dcsched.cli import profile, show, schedule, replay, train, convert  # noqa: F401,E402

__all__ = ["app", "main", "run"]
