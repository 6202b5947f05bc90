"""Training: the loop, the run's live state, checkpoints, resume, data position, generators, distributed plumbing.

Owns: :mod:`trainproof.train.loop` (the ``train`` invocation, read top to bottom), :mod:`trainproof.train.run` (live
objects, one optimizer step, capture/restore in the protocol's order), :mod:`trainproof.train.checkpoint` (when to save,
and the cross-rank commit), :mod:`trainproof.train.resume` (which generation to resume, agreed by every rank),
:mod:`trainproof.train.data` (epoch plan and cursor), :mod:`trainproof.train.rng` (every generator),
:mod:`trainproof.train.dist` and
:mod:`trainproof.train.launch` (ranks), :mod:`trainproof.train.config` and :mod:`trainproof.train.progress`. What a
generation holds is :mod:`trainproof.format`'s; the export bundle is :mod:`trainproof.export`'s.

May import: ``trainproof.format``, ``trainproof.tasks``, ``trainproof.errors``, ``storage``. Must not import
``trainproof.cli``,
``trainproof.proof``, ``trainproof.export`` or ``trainproof.lifecycle``: the loop is handed its stop flags, deadline
policy and finishing work by its caller (see the protocols in :mod:`trainproof.train.loop`).
"""
