"""Loss scaling and sharded clipping (internal): ``scaler`` (``ShardedGradScaler`` and the
optimizer's side of torch's scaling contract), ``clip`` and its arithmetic ``norms``. The
public names are :class:`oss_plus.ShardedGradScaler` and ``OSS.clip_grad_norm``.

Until 0.4, ``oss_plus.amp.<name>`` also answers the names of the 0.2 module ``oss_plus.amp``
(now :mod:`oss_plus.amp.scaler`), with a ``DeprecationWarning``.
"""

from oss_plus import _moved

__getattr__ = _moved.forward(__name__)
