"""The export bundle: weights, configuration, metrics, a plain-torch program and a README, committed like a generation.

Owns: :mod:`trainproof.export.bundle` (``trainproof export``: reads a generation, evaluates, writes the bundle with
write → verify → mark usable), :mod:`trainproof.export.standalone` (the bundle's plain-torch ``model.py`` and
``model.pt2``), :mod:`trainproof.export.bundle_readme` (its README), :mod:`trainproof.export.plot` (its loss curve) and
:mod:`trainproof.export.tensorfile` (safetensors files written and mapped tensor by tensor).

May import: ``trainproof.train`` (a sharded run's state is gathered through it), ``trainproof.format``,
``trainproof.tasks``,
``trainproof.errors``, ``storage``. Imported by ``trainproof.proof`` (the reload check), ``trainproof.lifecycle`` (a
deadline's finishing export) and ``trainproof.cli``; never by the trainer.
"""
