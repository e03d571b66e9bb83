"""A fairscale training script (OSS + ShardedDataParallel + ShardedGradScaler + clipping)
that runs unchanged with fairscale uninstalled: one line at the entry point.

    torchrun --nproc_per_node 2 examples/fairscale_sdp.py --steps 20

Everything below the ``install()`` line is fairscale 0.4.13 code. With fairscale absent,
``install()`` serves ``fairscale.optim``, ``fairscale.nn.data_parallel`` and
``fairscale.optim.grad_scaler`` from oss_plus; with fairscale installed, pass
``install(data_parallel=True)`` to replace the wrapper and the scaler too.
"""

import oss_plus.compat.fairscale

oss_plus.compat.fairscale.install(data_parallel=True)  # the one line added

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import batch, log, model, parser, setup  # noqa: E402
from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: E402
from fairscale.optim import OSS  # noqa: E402
from fairscale.optim.grad_scaler import ShardedGradScaler  # noqa: E402


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args.device)
    net = model(device)
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=1e-3)
    net = ShardedDataParallel(net, opt)
    scaler = ShardedGradScaler(enabled=device.type == "cuda")
    log(f"ShardedDataParallel is {ShardedDataParallel.__module__}.{ShardedDataParallel.__name__}")
    import fairscale

    log(f"fairscale served by oss_plus: {getattr(fairscale, '__oss_plus_shim__', False)}")
    for step in range(args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        with net.no_sync():  # gradient accumulation over two micro-batches
            with torch.autocast(device.type, enabled=device.type == "cuda"):
                loss = torch.nn.functional.mse_loss(net(x[:16]), y[:16])
            scaler.scale(loss).backward()
        with torch.autocast(device.type, enabled=device.type == "cuda"):
            loss = torch.nn.functional.mse_loss(net(x[16:]), y[16:])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = opt.clip_grad_norm(1.0)  # global norm over the gradient shards
        scaler.step(opt)
        scaler.update()
        owned = sum(p.grad is not None for p in net.parameters())
        if step % 10 == 0 or step == args.steps - 1:
            log(
                f"step {step:4d}  loss {loss.item():.5f}  grad norm {norm.item():.4f}  "
                f"grads held on rank 0: {owned} of {len(list(net.parameters()))}"
            )


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
