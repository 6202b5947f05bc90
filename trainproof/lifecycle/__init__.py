"""A run's lifecycle: stop signals, spot interruption notices, the deadline and its finishing export, planning.

Owns: :mod:`trainproof.lifecycle.signals` (SIGTERM/SIGINT set a flag; the deadline policy),
:mod:`trainproof.lifecycle.spot` (cloud interruption notices), :mod:`trainproof.lifecycle.finish` (the run's
``deadline.json`` and the export with its reload check after the final commit), :mod:`trainproof.lifecycle.planner`
(checkpoint interval and reserve for a rental, a pure calculation) and :mod:`trainproof.lifecycle.measure` (``plan
--measure``).

May import: ``trainproof.proof``, ``trainproof.train``, ``trainproof.tasks``, ``trainproof.errors``,
``trainproof.storage``. Must not import ``trainproof.cli``. The training loop never imports this package: the CLI
hands it the objects built here.
"""
