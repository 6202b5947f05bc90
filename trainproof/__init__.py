"""trainproof's job: training with exact resume, its proof, and the run's lifecycle, behind one command line.

Parts, in dependency order (each may import only the ones after it):

- :mod:`trainproof.cli`: Typer commands: parse options, call, map errors to exit codes;
- :mod:`trainproof.lifecycle`: stop signals, spot notices, the deadline and its finishing export, the planner;
- :mod:`trainproof.proof`: the verifier's paths, comparisons, report, audit, world checks, export reload checks;
- :mod:`trainproof.train`: the loop, run state, checkpoints, resume, data position, generators, distributed plumbing;
- :mod:`trainproof.tasks`: what is trained (built-in tasks and the interface a user's task implements);
- :mod:`trainproof.errors`: the few domain exceptions, with their exit codes.

Everything remote goes through :mod:`storage`, which never imports this package; this package never imports
s3fs or botocore. ``tests/test_architecture.py`` checks these rules.
"""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.monotonic()
"""When this package was first imported: measures a fresh process's start-up (see trainproof.lifecycle.finish)."""
