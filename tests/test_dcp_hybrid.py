"""Hybrid sharding in torch's DCP flow: 4 ranks as 2 shard groups of 2 replicas.

``get_state_dict`` -> ``dcp.save`` over the world: what each rank writes is read from DCP's own
final save plan (after its de-duplication), so that each element of the optimizer state is
written exactly once, as for DDP + the plain optimizer; the checkpoint then loads into other
topologies and equals the unsharded optimizer's state.
"""

import torch
import torch.distributed.checkpoint as dcp
from helpers import ddp_of, make_cut_model, train
from test_dcp import MORE, SAVED, assert_state, load_task, reference
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict

from oss_plus import OSS, hybrid_groups


class Recording(DefaultSavePlanner):
    """DCP's default planner, keeping this rank's final plan: what it writes."""

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        self.final = new_plan
        return super().finish_plan(new_plan)


def save_task(ctx, kind, rule, path):
    model = make_cut_model(0)
    ddp = ddp_of(ctx, model)
    if kind == "hybrid":
        shard, replicate = hybrid_groups(2)
        opt = OSS(
            model.parameters(),
            torch.optim.AdamW,
            group=shard,
            replicate_group=replicate,
            partition_rule=rule,
            lr=0.01,
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(ddp, opt, SAVED)
    model_sd, optim_sd = get_state_dict(model, opt)
    planner = Recording()
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=path,
        process_group=ctx.group,
        planner=planner,
    )
    writes = [
        (item.index.fqn, tuple(item.tensor_data.chunk.offsets), item.tensor_data.chunk.sizes)
        for item in planner.final.items
        if item.type != WriteItemType.BYTE_IO and item.index.fqn.startswith("optim.state.")
    ]
    return writes


def written(results):
    """Every write across ranks -> the elements written per state tensor (a write twice counts
    twice)."""
    elements, seen = {}, []
    for writes in results:
        for fqn, offsets, sizes in writes:
            seen.append((fqn, offsets))
            elements[fqn] = elements.get(fqn, 0) + int(torch.Size(sizes).numel())
    return elements, seen


def test_each_state_element_is_written_once_and_loads_at_other_topologies(pool, tmp_path):
    """The flat rule: its cut params save as chunks of one tensor per FQN."""
    rule = "flat"
    hybrid, ddp = str(tmp_path / "hybrid"), str(tmp_path / "ddp")
    elements, seen = written(pool.run(save_task, "hybrid", rule, hybrid, world_size=4))
    want, _ = written(pool.run(save_task, "ddp", rule, ddp, world_size=4))
    assert len(seen) == len(set(seen))  # no chunk written by two ranks
    assert elements == want  # each tensor's elements once, as DDP + AdamW writes them
    metadata = dcp.FileSystemReader(hybrid).read_metadata().state_dict_metadata
    for fqn, count in elements.items():
        entry = metadata[fqn]
        assert isinstance(entry, TensorStorageMetadata) and entry.size.numel() == count, fqn
    # the checkpoint reads back at other topologies: plain OSS at 4 ranks, DDP + AdamW at 2
    want_params, _ = reference(rule, SAVED + MORE)
    _, saved_state = reference(rule, SAVED)
    for kind, world in (("oss", 4), ("ddp", 2)):
        for loaded, lr, params in pool.run(load_task, kind, rule, hybrid, {}, world_size=world):
            assert_state(loaded, saved_state)
            assert lr == 0.01 and torch.equal(params, want_params)
