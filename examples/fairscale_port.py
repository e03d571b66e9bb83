"""A fairscale OSS script ported to oss_plus, with the before/after of each changed line.

    torchrun --nproc_per_node 2 examples/fairscale_port.py --steps 20

Before (fairscale 0.4.13)::

    from fairscale.optim import OSS
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9,
              broadcast_fp16=True)

After, option 1 (the drop-in adapter: same API, same checkpoint format, bug fixes)::

    from oss_plus.compat.fairscale import OSS

After, option 2 (keep ``from fairscale.optim import OSS`` everywhere, switch at the entry
point; works whether or not fairscale is installed)::

    import oss_plus.compat.fairscale
    oss_plus.compat.fairscale.install()
"""

import oss_plus.compat.fairscale

oss_plus.compat.fairscale.install()  # the one line added at the entry point

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import batch, log, model, parser, setup  # noqa: E402
from fairscale.optim import OSS  # noqa: E402  (resolves to oss_plus's adapter)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    args = parser(__doc__).parse_args()
    device = setup(args.device)
    net = DDP(model(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9, broadcast_fp16=True)
    log(f"OSS is {OSS.__module__}.{OSS.__name__}")
    for step in range(args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.clip_grad_norm(1.0)  # fairscale's API: reduces over WORLD
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.5f}")
    opt.consolidate_state_dict(recipient_rank=0)  # fairscale's checkpoint flow, unchanged
    if dist.get_rank() == 0:
        state = opt.state_dict()
        log(f"consolidated state for {len(state['state'])} params")


if __name__ == "__main__":
    main()  # returns first, so no optimizer outlives the process group
    dist.destroy_process_group()
