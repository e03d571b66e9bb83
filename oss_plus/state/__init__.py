"""Optimizer state paths (internal): index translation (``index``), the ``torch.optim``
state-dict API of ``OSS`` (``api``), moving state between ranks (``consolidate``), torch DCP
(``dcp``, ``sharded_tensor``, ``torch_callers``) and nested state (``nested``).

Until 0.4, ``oss_plus.state.<name>`` also answers the names of the 0.2 module
``oss_plus.state`` (now :mod:`oss_plus.state.index`), with a ``DeprecationWarning``.
"""

from oss_plus import _moved

__getattr__ = _moved.forward(__name__)
