"""trainproof's training side: tasks, state capture/restore, preemption, verifier, export, planner, CLI.

Everything remote goes through :mod:`storage`; this package never imports s3fs or botocore.
"""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.monotonic()
"""When this package was first imported: measures a fresh process's start-up (see job.finish)."""
