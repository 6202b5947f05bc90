"""Proof: the verifier's four paths, comparisons, the report, the audit, world-size checks, export reload checks.

Owns: :mod:`job.proof.protocol` (``trainproof verify``), :mod:`job.proof.paths` (training paths as fresh
processes, read back from the store), :mod:`job.proof.compare` (state-by-state comparison within a
tolerance), :mod:`job.proof.report` (``verification.json``, table, plot), :mod:`job.proof.audit`
(``verify --audit`` of a real run), :mod:`job.proof.world` (world-size equivalence and its negative control),
:mod:`job.proof.reload` (the export bundle's fresh-process reload check).

May import: ``job.export``, ``job.train``, ``job.format``, ``job.tasks``, ``job.errors``, ``storage``. Must not import ``job.cli`` or
``job.lifecycle``. Its negative controls (resume without RNG restore, per-rank mean) are explicit options of
the ``train`` command lines it starts, never environment switches.
"""
