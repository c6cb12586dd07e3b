"""The torch-only twin of exit_script.py (the reproduction in docs/debugging.md, "A rank killed by
SIGABRT at exit"): data-parallel training on gloo written by hand, with torch.distributed called
directly: ``python exit_script_torch.py bare`` ends without destroy_process_group(), ``plain`` with
it. Nothing in it is wrong, yet under load a rank may abort at exit (the bare ending, mostly: there
destroy_process_group() joins gloo's threads, since nothing else holds the group)."""
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + dist.get_rank())
for step in range(3):
    loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
    loss.backward()
    for p in model.parameters():  # average the gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(torch.tensor([loss.item()]))  # the mean loss, for a log line
if sys.argv[1] == "plain":
    dist.destroy_process_group()
