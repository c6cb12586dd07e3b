import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 16)).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = torch.empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(out, flat.clone())
dist.destroy_process_group()
