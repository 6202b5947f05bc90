"""Proof: the verifier's checks (its four paths first), comparisons, the report, the audit, export reload checks.

Owns: :mod:`trainproof.proof.protocol` (``trainproof verify``: its phases, folded over its list of checks),
:mod:`trainproof.proof.check` (the :class:`~trainproof.proof.check.Check` interface: everything proved declares its
runs, comparison, verdicts, failing names, diagnosis and report blocks; adding a check is writing the class and adding
it to ``Protocol._checks``), the checks :mod:`trainproof.proof.four_paths` (the four paths of docs/protocol.md, their
comparison, the export), :mod:`trainproof.proof.cuts` (extra cuts), :mod:`trainproof.proof.live` (live state against
restored state), :mod:`trainproof.proof.clipping`, :mod:`trainproof.proof.world` (world-size equivalence) and
:mod:`trainproof.proof.objective` (objective equivalence),
:mod:`trainproof.proof.verification` (the tail every verification shares: report, plot, pruning, outcome),
:mod:`trainproof.proof.paths` (training paths as fresh processes, read back from the store),
:mod:`trainproof.proof.compare` (state-by-state comparison within a tolerance), :mod:`trainproof.proof.equivalence` (the
float64 equivalence checks' shared arithmetic), :mod:`trainproof.proof.report` (``verification.json``, table, plot),
:mod:`trainproof.proof.audit` (``verify --audit`` of a real run), :mod:`trainproof.proof.reload` (export, then the
bundle's fresh-process reload check), :mod:`trainproof.proof.evidence` (what a verdict keeps).

May import: ``trainproof.export``, ``trainproof.train``, ``trainproof.format``, ``trainproof.tasks``,
``trainproof.errors``, ``storage``. Must not import ``trainproof.cli`` or ``trainproof.lifecycle``. Its negative
controls (resume without RNG restore, per-rank mean, mean of micro-batch means) are explicit options of the ``train``
command lines it starts, never environment switches.
"""
