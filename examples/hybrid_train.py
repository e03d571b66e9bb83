"""Hybrid sharding: optimizer state (and, with --stage 2, gradients) sharded inside each node,
replicated across nodes. The shard groups are the launch's nodes (LOCAL_WORLD_SIZE ranks).

One node:   torchrun --nproc_per_node 2 examples/hybrid_train.py --steps 50
Two nodes:  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \\
                --rdzv_endpoint HOST0:29500 --rdzv_id job1 examples/hybrid_train.py
"""

import torch
import torch.distributed as dist
from _common import batch, log, model, parser, setup
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedDataParallel, hybrid_groups


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage (default 2)")
    p.add_argument("--out", default=None, help="write the final params here (raw float32)")
    args = p.parse_args()
    device = setup(args.device)
    shard, replicate = hybrid_groups()  # contiguous ranks per node: LOCAL_WORLD_SIZE
    module = model(device)
    opt = OSS(
        module.parameters(), torch.optim.AdamW, group=shard, replicate_group=replicate, lr=1e-3
    )
    if args.stage == 2:  # gradients reduced in the node, then across nodes 1/S per rank
        net: torch.nn.Module = ShardedDataParallel(module, opt)
    else:  # ZeRO-1: DDP all-reduces the gradients over every rank
        net = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    for step in range(args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.5f}")
    nodes, per_node = dist.get_world_size(replicate), dist.get_world_size(shard)
    log(f"hybrid ZeRO-{args.stage}: {nodes} replica set(s) x {per_node} shard(s)")
    if args.out and dist.get_rank() == 0:
        flat = torch.cat([q.detach().reshape(-1).float().cpu() for q in module.parameters()])
        flat.numpy().tofile(args.out)


if __name__ == "__main__":
    main()  # returns first, so no optimizer outlives the process group
    dist.destroy_process_group()
