"""trainproof's training side: tasks, state capture/restore, preemption, verifier, export, planner, CLI.

Everything remote goes through :mod:`storage`; this package never imports s3fs or botocore.
"""

__version__ = "0.1.0"
