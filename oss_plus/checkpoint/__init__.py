"""Safetensors checkpoints of a sharded optimizer: save, load at any world size, convert.

A checkpoint is a directory: ``index.json`` (everything that is not a tensor, as type-tagged
JSON) plus safetensors files holding the state tensors. ``save_checkpoint(sharded=True)``
has every rank write the state it owns, in parallel, with no tensor leaving its rank;
``sharded=False`` streams every rank's tensors to rank 0 into one file in bounded chunks.
``load_checkpoint`` works for both layouts at any world size and under any partition
rule: each rank reads only the tensors it owns now. Under ``partition_rule="flat"`` a rank
saves its own pieces of split params (format version 3) and loads only the stored elements
of the pieces it holds. Saves are atomic (the index is replaced last, after every rank
succeeded) and nothing on a load path unpickles anything. See ``docs/checkpoints.md``.

The package, by concern (imports flow down the list):

- :mod:`~oss_plus.checkpoint.values`, :mod:`~oss_plus.checkpoint.format`: the on-disk
  format (pure: type-tagged JSON values, dtype strings, the index, file names).
- :mod:`~oss_plus.checkpoint.plan`: what each rank writes, as a frozen ``SavePlan`` (pure).
- :mod:`~oss_plus.checkpoint.storage`: files (streamed safetensors writes, staging, the
  atomic commit); no collectives.
- :mod:`~oss_plus.checkpoint.comm`: the save's collectives (JSON metadata, the bounded
  tensor stream to rank 0), no pickle.
- :mod:`~oss_plus.checkpoint.validate`: a checkpoint checked before any tensor is read
  (the index, the files' sizes, the fit to the loading optimizer);
  :mod:`~oss_plus.checkpoint.assemble`: the lazy, checked reads of the stored tensors a
  rank asks for, and the state values they make (whole, stitched, or a piece).
- :mod:`~oss_plus.checkpoint.save`, :mod:`~oss_plus.checkpoint.read`: the public functions;
  :mod:`~oss_plus.checkpoint.background`: asynchronous saves (staging, the writer thread).
- :mod:`~oss_plus.checkpoint.cli`: ``python -m oss_plus ckpt inspect | convert``.
"""

from oss_plus.checkpoint.background import PREVIOUS_SAVE_FAILED, staging_nbytes
from oss_plus.checkpoint.migrate import write_state_dict
from oss_plus.checkpoint.plan import NOT_OSS
from oss_plus.checkpoint.read import load_checkpoint, read_state_dict
from oss_plus.checkpoint.save import save_checkpoint

__all__ = [
    "NOT_OSS",
    "PREVIOUS_SAVE_FAILED",
    "load_checkpoint",
    "read_state_dict",
    "save_checkpoint",
    "staging_nbytes",
    "write_state_dict",
]
