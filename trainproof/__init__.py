"""trainproof: training with exact resume, its proof, and the run's lifecycle, behind one command line.

Parts, in dependency order (each may import only the ones after it; docs/architecture.md draws them):

- :mod:`trainproof.cli`: Typer commands: parse options, call, map errors to exit codes;
- :mod:`trainproof.lifecycle`: stop signals, spot notices, the deadline and its finishing export, the planner;
- :mod:`trainproof.proof`: the verifier's checks and paths, comparisons, report, audit, export reload checks;
- :mod:`trainproof.export`: the bundle a run leaves (weights, evaluation, Hugging Face directory, loss curve);
- :mod:`trainproof.train`: the loop, saving, resume, data position, generators, distributed plumbing;
- :mod:`trainproof.format`, :mod:`trainproof.tasks`, :mod:`trainproof.data`: what is stored and how it is read
  back; what is trained; datasets in the bucket;
- :mod:`trainproof.errors`: the few domain exceptions, with their exit codes;
- :mod:`trainproof.storage`: generations in a folder or a bucket; imports nothing else of this package.

Only :mod:`trainproof.storage` imports s3fs or botocore. ``tests/test_architecture.py`` checks these rules.
"""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.monotonic()
"""When this package was first imported: measures a fresh process's start-up (see trainproof.lifecycle.finish)."""
