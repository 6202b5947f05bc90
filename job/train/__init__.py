"""Training: the loop, the run's live state, checkpoints, resume, data position, generators, distributed plumbing.

Owns: :mod:`job.train.loop` (the ``train`` invocation, read top to bottom), :mod:`job.train.run` (live objects,
one optimizer step, capture/restore in the protocol's order), :mod:`job.train.checkpoint` (when to save, and the
cross-rank commit), :mod:`job.train.resume` (which generation to resume, agreed by every rank),
:mod:`job.train.data` (epoch plan and cursor), :mod:`job.train.rng` (every generator), :mod:`job.train.dist` and
:mod:`job.train.launch` (ranks), :mod:`job.train.config` and :mod:`job.train.progress`. What a generation holds
is :mod:`job.format`'s; the export bundle is :mod:`job.export`'s.

May import: ``job.format``, ``job.tasks``, ``job.errors``, ``storage``. Must not import ``job.cli``,
``job.proof``, ``job.export`` or ``job.lifecycle``: the loop is handed its stop flags, deadline policy and
finishing work by its caller (see the protocols in :mod:`job.train.loop`).
"""
