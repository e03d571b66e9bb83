"""Save a sharded safetensors checkpoint, then resume it at any world size.

    torchrun --nproc_per_node 2 examples/checkpoint_resume.py --dir /tmp/ckpt --steps 20
    torchrun --nproc_per_node 1 examples/checkpoint_resume.py --dir /tmp/ckpt --resume --steps 20

Every rank writes only the state it owns (no gather); loading at another world size reads
only the tensors each rank owns now. With ``--dcp`` the same through torch's
``torch.distributed.checkpoint`` (``get_state_dict`` / ``dcp.save``, ``dcp.load`` /
``set_state_dict``; docs/checkpoints.md), model and optimizer in one checkpoint.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import batch, log, model, parser, setup
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from oss_plus import OSS, load_checkpoint, save_checkpoint


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--dir", required=True, help="checkpoint directory")
    p.add_argument("--resume", action="store_true", help="load --dir before training")
    p.add_argument("--dcp", action="store_true", help="use torch.distributed.checkpoint")
    args = p.parse_args()
    device = setup(args.device)
    net = model(device)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-3)
    start = 0
    if args.resume and args.dcp:
        start = load_dcp(net, opt, args.dir)
        log(f"resumed at step {start} on {dist.get_world_size()} rank(s) (dcp)")
    elif args.resume:
        net.load_state_dict(torch.load(os.path.join(args.dir, "model.pt"), weights_only=True))
        load_checkpoint(opt, args.dir)
        start = int(opt.param_groups[0].get("resume_step", 0))
        log(f"resumed at step {start} on {dist.get_world_size()} rank(s)")
    for step in range(start, start + args.steps):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        for p_ in net.parameters():  # no DDP here: average the grads by hand
            dist.all_reduce(p_.grad)
            p_.grad /= dist.get_world_size()
        opt.step()
    log(f"step {start + args.steps - 1}  loss {loss.item():.5f}")
    if args.dcp:
        save_dcp(net, opt, args.dir, start + args.steps)
        log(f"saved {args.dir} from {dist.get_world_size()} rank(s) (dcp)")
        return
    for group in opt.param_groups:
        group["resume_step"] = start + args.steps
    save_checkpoint(opt, args.dir)  # collective; sharded by default
    if dist.get_rank() == 0:
        torch.save(net.state_dict(), os.path.join(args.dir, "model.pt"))
    log(f"saved {args.dir} from {dist.get_world_size()} rank(s)")


def save_dcp(net: torch.nn.Module, opt: OSS, path: str, step: int) -> None:
    """Model and optimizer in one DCP checkpoint; each rank writes the state it owns."""
    model_sd, optim_sd = get_state_dict(net, opt)  # collective
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=path)  # collective


def load_dcp(net: torch.nn.Module, opt: OSS, path: str) -> int:
    """Load a DCP checkpoint at this world size; return the step it was saved at."""
    model_sd, optim_sd = get_state_dict(net, opt)  # the template: what this rank owns now
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)  # collective
    set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return int(state["step"])


if __name__ == "__main__":
    main()  # returns first, so no optimizer outlives the process group
    dist.destroy_process_group()
