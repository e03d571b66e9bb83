"""AMP with a sharded grad scaler, sharded gradient clipping and a bf16 wire.

    torchrun --nproc_per_node 2 examples/amp_clip.py --steps 50

``ShardedGradScaler`` agrees on inf/nan across ranks, so every rank skips the same steps;
``clip_grad_norm`` reduces over the optimizer's group; ``broadcast_dtype=torch.bfloat16``
halves the bytes of the parameter sync while each owner keeps its exact fp32 weights.
"""

import torch
import torch.distributed as dist
from _common import batch, log, model, parser, setup
from torch.nn.parallel import DistributedDataParallel as DDP

from oss_plus import OSS, ShardedGradScaler


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args.device)
    net = DDP(model(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-3, broadcast_dtype=torch.bfloat16)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = ShardedGradScaler(device.type)
    skipped = 0
    for step in range(args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = opt.clip_grad_norm(1.0)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
        if step % 10 == 0 or step == args.steps - 1:
            log(
                f"step {step:4d}  loss {loss.item():.5f}  grad norm {norm.item():.4f}  "
                f"scale {scaler.get_scale():.0f}"
            )
    log(f"skipped steps (same on every rank): {int(skipped)}")


if __name__ == "__main__":
    main()  # returns first, so no optimizer outlives the process group
    dist.destroy_process_group()
