"""Glue for training frameworks, one module per framework, each importing its framework.

The core never imports these modules or the frameworks: import one only where its framework
is installed.

* :mod:`oss_plus.integrations.mmengine`: the optimizer in mmengine's ``OPTIMIZERS`` registry
  and a hook that consolidates on every rank before ``CheckpointHook`` saves.
"""
