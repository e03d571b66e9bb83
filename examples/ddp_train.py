"""A DDP training loop with oss_plus.OSS: each rank keeps 1/world_size of Adam's state.

torchrun --nproc_per_node 2 examples/ddp_train.py --steps 50
"""

import torch
import torch.distributed as dist
from _common import batch, log, model, parser, setup
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args.device)
    net = DDP(model(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    for step in range(args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.5f}  lr {scheduler.get_last_lr()[0]:.2e}")
    owned = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    total = sum(p.numel() for p in net.parameters())
    print(f"rank {dist.get_rank()}: optimizer state for {owned}/{total} params", flush=True)


if __name__ == "__main__":
    main()  # returns first, so no optimizer outlives the process group
    dist.destroy_process_group()
