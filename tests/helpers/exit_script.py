"""A user's training script, run as a real 2-rank job by the exit tests (tests/helpers/exit_runs.py):
``python exit_script.py ENDING STAGE`` with torchrun's variables set. It trains a few steps at ZeRO
``STAGE`` and ends the way ENDING says; the exit status must be the script's own (0, 7 for sys.exit,
1 for an exception), never a signal.

Endings:
- plain: no engine.destroy(), torch.distributed.destroy_process_group() at the end (what many scripts do)
- destroy: engine.destroy(), then destroy_process_group()
- bare: neither (the interpreter's exit tears everything down)
- exit: sys.exit(7) in the middle of a step, after backward (stage 2/3 reductions may be in flight)
- raise: an exception in the middle of a step, after backward
- forward: an engine without optimizer (forward passes only), nothing destroyed
"""
import sys

import torch
import torch.distributed as dist

import zero_ext

ending, stage = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
if ending != "forward":
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
engine = zero_ext.initialize(model=model, config=config)[0]
gen = torch.Generator().manual_seed(1 + dist.get_rank())
for step in range(3):
    x = torch.randn(4, 16, generator=gen)
    if ending == "forward":
        with torch.no_grad():
            engine(x)
        continue
    engine.backward(engine(x).pow(2).mean())
    if step == 1 and ending == "exit":
        sys.exit(7)
    if step == 1 and ending == "raise":
        raise RuntimeError("the user's script failed mid-step")
    engine.step()
if ending == "destroy":
    engine.destroy()
if ending in ("plain", "destroy"):
    dist.destroy_process_group()
