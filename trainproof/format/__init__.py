"""The generation format: what one generation holds and how it is read back, written by train, read by proof and export.

Owns: :mod:`trainproof.format.state` (the training state as safe weights-only bytes: layout, schema, decoding,
self-consistency checks, the bounded per-generation ``History``), :mod:`trainproof.format.history` (a state's full
history reassembled from the run's generations), :mod:`trainproof.format.contract` (``plan.json`` and the run
contract), :mod:`trainproof.format.shard_files` (the names of a sharded generation's DCP files),
:mod:`trainproof.format.identity` (the code identity recorded in every state) and :mod:`trainproof.format.protect`
(which generation retention keeps for the audit).

May import: ``trainproof.errors``, ``storage``. Knows nothing of the loop, the verifier or the tasks: it is the
record both sides agree on.
"""
