"""Drop-in adapters with the APIs of the two anchors, built on :class:`oss_plus.OSS`.

* :mod:`oss_plus.compat.fairscale`: ``OSS`` (fairscale 0.4.13's ``fairscale.optim.OSS``) and
  ``install()``, which makes ``from fairscale.optim import OSS`` resolve to it.
* :mod:`oss_plus.compat.torch`: ``ZeroRedundancyOptimizer`` (torch 2.x's
  ``torch.distributed.optim.ZeroRedundancyOptimizer``) and ``install()``, which makes that
  name resolve to it.

Neither imports fairscale. See ``docs/migration.md`` for the differences (bug fixes only).
"""
