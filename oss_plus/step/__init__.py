"""The local step (internal): what this rank steps and how ``OSS`` follows its params.

``shard`` (the inner optimizer over this rank's shard), ``pieces`` (the flat rule's pieces),
``params`` (validation of ``params`` and ``optim``), ``replan`` (plan again, lay out again),
``driver`` (how a step's sync runs), ``views`` (the plan's read-only views on ``OSS``). Owned
by :class:`oss_plus.OSS`; see ``docs/design.md``.
"""
