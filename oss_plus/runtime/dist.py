"""Small helpers around ``torch.distributed`` shared by the modules that communicate.

Every helper takes the process group explicitly; ranks are group-local unless a name says
``global``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from oss_plus.runtime.exit import drain_at_exit

logger = logging.getLogger(__name__)

#: Message when no process group exists.
NOT_INITIALIZED = (
    "oss_plus needs an initialized torch.distributed process group: call "
    "torch.distributed.init_process_group(...) first (for a single process: "
    "init_process_group('gloo', init_method='tcp://127.0.0.1:29500', rank=0, world_size=1)), "
    "or launch with torchrun"
)


def resolve_group(group: Any) -> Any:
    """Return ``group``, or WORLD when it is None, after checking torch.distributed is ready.

    Raises:
        RuntimeError: no default process group has been initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(NOT_INITIALIZED)
    group = dist.group.WORLD if group is None else group
    drain_at_exit()  # gloo's workers may still need the GIL at exit (oss_plus.runtime.exit)
    return group


def global_rank(group: Any, rank: int) -> int:
    """Return the global rank of group-local ``rank``."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def comm_device(group: Any) -> torch.device:
    """Return the device collectives on ``group`` must use (CUDA for NCCL, else CPU)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: How long :func:`await_release` waits for a worker thread before it gives up (seconds).
RELEASE_TIMEOUT_S = 10.0


def use_counts(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Return the C++ use count of every tensor (taken before handing them to a collective)."""
    return [t._use_count() for t in tensors]  # type: ignore[attr-defined]


def await_release(tensors: Sequence[torch.Tensor], counts: Sequence[int], group: Any) -> None:
    """Return once no collective of ``group`` holds ``tensors`` any more (use counts back).

    Why: a gloo worker thread runs the collective and drops its references to the tensors
    *after* ``wait()`` has returned. With torch >= 2.10, dropping the reference that is not
    Python's own releases the tensor's Python object, which takes the GIL. If the process
    is exiting by then, the interpreter ends that thread with a forced unwind and the
    process aborts: SIGABRT, "terminate called without an active exception" (measured: 5
    of 25 ``mp.spawn`` runs of OSS + ShardedDataParallel; the core dump shows
    ``~AsyncBroadcastWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit`` under ``ProcessGroupGloo::runLoop``). So every collective of
    oss_plus returns only after the worker let go: this yields the GIL (``sleep(0)``) until
    every count is back to what it was before the collective. Usually it already is, or the
    worker needs one GIL hand-off. NCCL's work objects are released by its watchdog
    thread instead, later and on a timer, so NCCL groups are not waited for.

    Args:
        tensors: the tensors given to the collective(s), still referenced by the caller.
        counts: their :func:`use_counts` from before the collective(s).
        group: the group the collectives ran on.
    """
    if releases_late(group):
        await_counts(tensors, counts)


def releases_late(group: Any) -> bool:
    """Whether ``group``'s collectives may drop their tensors after ``wait()`` returned (gloo:
    :func:`await_release` waits for them; NCCL: not waited for). Look it up once per layout:
    ``dist.get_backend`` costs a few microseconds of Python per call."""
    return dist.get_backend(group) != dist.Backend.NCCL


def await_counts(tensors: Sequence[torch.Tensor], counts: Sequence[int]) -> None:
    """:func:`await_release` on a group :func:`releases_late` is true of (checked by the
    caller)."""
    deadline = None
    for tensor, count in zip(tensors, counts):
        while tensor._use_count() > count:  # type: ignore[attr-defined]
            if deadline is None:
                deadline = time.monotonic() + RELEASE_TIMEOUT_S
            elif time.monotonic() > deadline:
                logger.warning("a collective still holds a tensor after %ss", RELEASE_TIMEOUT_S)
                return
            time.sleep(0)


@contextlib.contextmanager
def released(group: Any, *tensors: torch.Tensor) -> Iterator[None]:
    """Run blocking collectives on ``tensors`` inside; leave once the worker dropped them.

    Example:
        >>> with released(group, total):  # doctest: +SKIP
        ...     dist.all_reduce(total, group=group)
    """
    counts = use_counts(tensors)
    yield
    await_release(tensors, counts, group)


#: Raised on the ranks that did not fail themselves when a peer failed: ``ranks`` names the
#: failed ranks (:func:`name_ranks`), ``me`` this rank's global rank.
PEER_FAILED = (
    "{ranks} failed (see their error); this rank (global rank {me}) stopped too so that no "
    "rank waits forever in a collective"
)


def group_members(group: Any) -> list[int]:
    """Return the global ranks of ``group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def _group_text(members: Sequence[int]) -> str:
    """``[1, 3]``, or for a long group its first, second and last global ranks and its size."""
    if len(members) <= 8:
        return str(list(members))
    return f"[{members[0]}, {members[1]}, ..., {members[-1]}] ({len(members)} ranks)"


def name_ranks(members: Sequence[int], ranks: Sequence[int]) -> str:
    """Name the group ranks ``ranks`` of the group of global ranks ``members`` by their global
    ranks, and by their group ranks too when the two numberings differ (PURE).

    Example:
        >>> name_ranks([0, 1, 2, 3], [1])
        'global rank(s) [1]'
        >>> name_ranks([1, 3], [0])
        'global rank(s) [1] (rank(s) [0] of the group [1, 3])'
    """
    named = f"global rank(s) {[members[r] for r in ranks]}"
    if list(members) == list(range(len(members))):
        return named
    return f"{named} (rank(s) {list(ranks)} of the group {_group_text(members)})"


def name_rank(members: Sequence[int], rank: int) -> str:
    """:func:`name_ranks` for one rank (PURE).

    Example:
        >>> name_rank([2, 3], 1)
        'global rank 3 (rank 1 of the group [2, 3])'
    """
    if list(members) == list(range(len(members))):
        return f"global rank {members[rank]}"
    return f"global rank {members[rank]} (rank {rank} of the group {_group_text(members)})"


def peer_failed(members: Sequence[int], failed: Sequence[int], me: int) -> str:
    """What a rank that did not fail raises: :data:`PEER_FAILED` for the group ranks
    ``failed`` of the group of global ranks ``members``, seen from group rank ``me`` (PURE).

    Example:
        >>> peer_failed([2, 3], [1], 0).split(" (see")[0]
        'global rank(s) [3] (rank(s) [1] of the group [2, 3]) failed'
    """
    return PEER_FAILED.format(ranks=name_ranks(members, failed), me=members[me])


#: Exception types re-raised with the same type on the ranks that did not fail themselves.
_SHARED_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        FileNotFoundError,
        NotADirectoryError,
        PermissionError,
        NotImplementedError,
        OSError,
    )
}


def error_class(kind: str) -> type[Exception]:
    """The exception class a rank raises for a peer's error of type name ``kind``: the same
    for the common types, else RuntimeError (PURE)."""
    return _SHARED_ERRORS.get(kind, RuntimeError)


T = TypeVar("T")


#: A piece of a message: (item index in the stream, first byte within the item, length).
Piece = tuple[int, int, int]


def message_plan(
    sizes: Sequence[int],
    *,
    pack_bytes: int = 16 << 20,
    alone_bytes: int = 1 << 20,
    chunk_bytes: int | None = None,
    kinds: Sequence[Hashable] | None = None,
) -> list[list[Piece]]:
    """Cut a stream of items of ``sizes`` bytes into bounded messages (pure).

    The one packing rule of every bounded transfer (state exchange, the consolidated
    checkpoint stream): items of at least ``min(alone_bytes, pack_bytes)`` travel alone,
    whole or in chunks of at most ``chunk_bytes``; smaller ones are packed together up to
    ``pack_bytes``; a change of ``kinds[i]`` (e.g. source, destination, dtype) starts a new
    message; empty items travel in no message. Both ends compute the same plan.

    Example:
        >>> message_plan([4, 8, 0, 4])
        [[(0, 0, 4), (1, 0, 8), (3, 0, 4)]]
        >>> message_plan([4, 8, 4], kinds=["a", "a", "b"])
        [[(0, 0, 4), (1, 0, 8)], [(2, 0, 4)]]
        >>> message_plan([10], alone_bytes=8, chunk_bytes=4)
        [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2)]]
    """
    messages: list[list[Piece]] = []
    run: list[Piece] = []
    filled, kind = 0, None
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        alone = n >= min(alone_bytes, pack_bytes)
        new_kind = kinds[i] if kinds is not None else None
        if run and (alone or filled + n > pack_bytes or new_kind != kind):
            messages.append(run)
            run, filled = [], 0
        if alone:
            step = chunk_bytes or n
            messages.extend([(i, start, min(step, n - start))] for start in range(0, n, step))
            continue
        run.append((i, 0, n))
        filled, kind = filled + n, new_kind
    if run:
        messages.append(run)
    return messages


def pad_bytes(data: bytes, group: Any) -> tuple[torch.Tensor, list[int]]:
    """Return ``data`` as uint8 padded to the longest of the group's, and every length."""
    device = comm_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size(group))]
    with released(group, length, *lengths):
        dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded, sizes


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Return the ``data`` of every rank of ``group`` (collective; nothing is pickled)."""
    mine, sizes = pad_bytes(data, group)
    everyone = [torch.empty_like(mine) for _ in sizes]
    with released(group, mine, *everyone):
        dist.all_gather(everyone, mine, group=group)
    return [bytes(t[:n].cpu().numpy()) for t, n in zip(everyone, sizes)]


def agree(
    error: BaseException | None,
    group: Any,
    *,
    value: int = 0,
    cleanup: Callable[[], None] | None = None,
) -> list[int]:
    """End a collective phase: raise on every rank of ``group`` if any rank has ``error``.

    The one mechanism by which an error seen on some ranks reaches all of them (modelled on
    torch DCP's ``_DistWrapper``). One ``all_gather`` of ``(failed, value)`` per rank; when
    a rank failed, ``cleanup`` runs on every rank, the error texts travel (as bytes, never
    pickled), the failed rank re-raises its own error and every other rank raises an error
    of the same type (for the common types; else RuntimeError) naming the failed rank(s) and
    the first one's message (:func:`peer_failed`: global ranks, and the ranks within
    ``group`` when ``group`` is not numbered like the world, e.g. a replicate group).

    Args:
        error: what this rank raised in the phase, or None.
        group: the process group.
        value: an int64 every rank contributes (e.g. a fingerprint), returned by rank.
        cleanup: run on every rank before raising, when any rank failed.

    Returns:
        ``value`` of every rank, when no rank failed.

    .. warning:: Collective: call on every rank of ``group``.
    """
    device = comm_device(group)
    mine = torch.tensor([int(error is not None), value], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    with released(group, mine, *gathered):
        dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()  # one device-to-host read for every rank's row
    failed = [r for r, (flag, _) in enumerate(rows) if flag]
    if not failed:
        return [v for _, v in rows]
    if cleanup is not None:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the original error matters more
            logger.warning("cleanup after a failed collective phase failed", exc_info=True)
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    messages = all_gather_bytes(text.encode("utf-8", "replace"), group)
    if error is not None:
        raise error
    kind, _, message = messages[failed[0]].decode("utf-8", "replace").partition(": ")
    cls = error_class(kind)
    members = group_members(group)
    head = peer_failed(members, failed, dist.get_rank(group))
    raise cls(f"{head}; global rank {members[failed[0]]} raised {kind}: {message}")


def run_phase(fn: Callable[[], T], group: Any, *, cleanup: Callable[[], None] | None = None) -> T:
    """Run ``fn`` on every rank of ``group``; if it raised on any rank, raise on all.

    See :func:`agree` for what every rank raises.

    Example:
        >>> meta = run_phase(lambda: read_index(path), group)  # doctest: +SKIP

    .. warning:: Collective: call on every rank of ``group``.
    """
    result, error = capture(fn)
    agree(error, group, cleanup=cleanup)
    return cast(T, result)


def capture(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """Run ``fn``; return ``(result, None)``, or ``(None, error)`` when it raised.

    What a rank does before it reports to its peers (:func:`agree`, or the status slots of
    :mod:`oss_plus.wire.sync`), so that no rank leaves a collective phase alone.
    """
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the caller raises it on every rank
        return None, exc
