"""The export bundle: weights, configuration, metrics, a plain-torch program and a README, committed like a generation.

Owns: :mod:`job.export.bundle` (``trainproof export``: reads a generation, evaluates, writes the bundle with
write → verify → mark usable), :mod:`job.export.standalone` (the bundle's plain-torch ``model.py`` and
``model.pt2``), :mod:`job.export.bundle_readme` (its README), :mod:`job.export.plot` (its loss curve) and
:mod:`job.export.tensorfile` (safetensors files written and mapped tensor by tensor).

May import: ``job.train`` (a sharded run's state is gathered through it), ``job.format``, ``job.tasks``,
``job.errors``, ``storage``. Imported by ``job.proof`` (the reload check), ``job.lifecycle`` (a deadline's
finishing export) and ``job.cli``; never by the trainer.
"""
