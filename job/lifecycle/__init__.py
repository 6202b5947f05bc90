"""A run's lifecycle: stop signals, spot interruption notices, the deadline and its finishing export, planning.

Owns: :mod:`job.lifecycle.signals` (SIGTERM/SIGINT set a flag; the deadline policy), :mod:`job.lifecycle.spot`
(cloud interruption notices), :mod:`job.lifecycle.finish` (the run's ``deadline.json`` and the export with its
reload check after the final commit), :mod:`job.lifecycle.planner` (checkpoint interval and reserve for a
rental, a pure calculation) and :mod:`job.lifecycle.measure` (``plan --measure``).

May import: ``job.proof``, ``job.train``, ``job.tasks``, ``job.errors``, ``storage``. Must not import ``job.cli``.
The training loop never imports this package: the CLI hands it the objects built here.
"""
