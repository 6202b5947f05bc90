"""Proof: the verifier's four paths and its checks, comparisons, the report, the audit, export reload checks.

Owns: :mod:`job.proof.protocol` (``trainproof verify``: the four paths of docs/protocol.md and their comparison),
:mod:`job.proof.check` (the :class:`~job.proof.check.Check` interface: everything proved besides the four paths
declares its runs, comparison, verdicts, failing names, diagnosis and report blocks; the protocol derives its
verdicts and report from its list of checks, so adding a check is writing the class and adding it to
``Protocol._checks``), the checks :mod:`job.proof.cuts` (extra cuts), :mod:`job.proof.world` (world-size
equivalence) and :mod:`job.proof.objective` (objective equivalence), :mod:`job.proof.verification` (the tail every
verification shares: report, plot, pruning, outcome), :mod:`job.proof.paths` (training paths as fresh processes,
read back from the store), :mod:`job.proof.compare` (state-by-state comparison within a tolerance),
:mod:`job.proof.equivalence` (the float64 equivalence checks' shared arithmetic), :mod:`job.proof.report`
(``verification.json``, table, plot), :mod:`job.proof.audit` (``verify --audit`` of a real run),
:mod:`job.proof.reload` (export, then the bundle's fresh-process reload check), :mod:`job.proof.evidence` (what a
verdict keeps).

May import: ``job.export``, ``job.train``, ``job.format``, ``job.tasks``, ``job.errors``, ``storage``. Must not import
``job.cli`` or ``job.lifecycle``. Its negative controls (resume without RNG restore, per-rank mean, mean of micro-batch
means) are explicit options of the ``train`` command lines it starts, never environment switches.
"""
