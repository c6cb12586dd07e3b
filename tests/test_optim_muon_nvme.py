"""Muon ("type": "Muon") with offload_optimizer.device = "nvme", and
zero_optimization.save_muon_momentum_buffer_in_memory (optim/muon_nvme.py).

NVMe offload changes where the masters, momentum buffers and Adam moments are kept between steps, not
the arithmetic: training must equal Muon without offload bit for bit (losses, parameters, masters,
momentum buffers), stages 1-3, 1 and 2 ranks, fp32 and bf16, stage-3 sub-groups and stage-1/2
partitions cut into sub-groups, with the momentum in the swap files or in host memory. The memory
account puts the momentum where it lives, and a checkpoint of an NVMe run loads into a run without
offload. A write that fails in Muon's step (not a transaction yet) stops the engine by name."""
import pytest
import torch

from helpers.engine import fp32_masters, full_params, train
from helpers.harness import run_ranks
from helpers.models import MODELS

STEPS = 3

# (stage, dtype, world, model, options): "sliced" cuts a stage-1/2 partition into sub-groups; "memory" keeps
# the momentum in host memory; "param_nvme" puts stage 3's 16-bit pieces on NVMe too
CASES = [
    (1, "fp32", 1, "gpt", {"sliced": True, "pipeline_read": True}),
    (1, "bf16", 2, "mlp", {"memory": True, "fast_init": True}),
    (2, "bf16", 2, "gpt", {"sliced": True, "memory": True, "pipeline_write": True}),
    (2, "fp32", 1, "mlp", {"fast_init": True, "pipeline_read": True, "pipeline_write": True}),
    (3, "fp32", 2, "gpt", {"pipeline_read": True, "pipeline_write": True}),
    (3, "bf16", 1, "gpt", {"memory": True, "fast_init": True}),
    (3, "bf16", 2, "gpt", {"param_nvme": True, "pipeline_read": True}),  # the 16-bit pieces on NVMe too
]


def _config(stage, dtype, offload, memory=False):
    zero = {"stage": stage, "save_muon_momentum_buffer_in_memory": memory}
    if offload is not None:
        offload = dict(offload)
        if offload.pop("sliced", False):  # several sub-groups, a short last one
            zero["sub_group_size"] = 70
        if offload.pop("param_nvme", False):
            zero["offload_param"] = {"device": "nvme", "nvme_path": offload["nvme_path"]}
        zero["offload_optimizer"] = offload
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=80)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "Muon", "params": {"lr": 2e-2, "weight_decay": 0.01, "ns_method": "gram"}},
            "zero_optimization": zero}


def _state_of(engine, key, names):
    """name -> the full optimizer state ``key`` of parameters ``names`` (collective)."""
    from zero_ext.utils import safe_get_full_optimizer_state

    return {n: safe_get_full_optimizer_state(p, key) for n, p in engine.module.named_parameters() if n in names}


def _muon_names(engine):
    return [n for n, p in engine.module.named_parameters() if p.requires_grad and p.use_muon]


def _train(stage, dtype, model_name, offload, memory=False, save_to=None, load_from=None):
    import zero_ext

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    engine, *_ = zero_ext.initialize(model=model, config=_config(stage, dtype, offload, memory),
                                     model_parameters=model.parameters())
    if load_from is not None:
        engine.load_checkpoint(load_from, tag="t")
    gen = torch.Generator().manual_seed(7)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    steps = [[[MODELS[model_name].batch(2, gen, dt) for _ in range(world)]] for _ in range(STEPS)]
    losses = train(engine, steps, rank)
    muon = _muon_names(engine)
    opt = engine.optimizer  # this rank's fp32 bytes of the Muon groups and of the Adam groups
    sizes = [((g.hi - g.lo) * 4, opt.optimizer.group_of(g.master)["use_muon"]) for g in opt.flat_groups]
    momentum = _state_of(engine, "momentum_buffer", muon)
    out = {"losses": losses, "params": full_params(engine), "masters": fp32_masters(engine), "momentum": momentum,
           "memory": engine.memory_breakdown(), "muon": muon,
           "group_bytes": (sum(n for n, m in sizes if m), sum(n for n, m in sizes if not m)),
           "adam_sq": _state_of(engine, "exp_avg_sq", [n for n, p in engine.module.named_parameters()
                                                      if p.requires_grad and n not in muon])}
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="t")
    engine.destroy()
    return out


def _nvme_and_plain(stage, dtype, model_name, options, nvme_path):
    options = dict(options)
    memory = options.pop("memory", False)
    nvme = _train(stage, dtype, model_name, {"device": "nvme", "nvme_path": nvme_path, **options}, memory)
    return nvme, _train(stage, dtype, model_name, None)


def _id(case):
    stage, dtype, world, model, opts = case
    return f"z{stage}-{dtype}-n{world}-{model}" + "".join(f"-{k}" for k in opts)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_muon_with_nvme_offload_equals_muon_without_offload_bit_for_bit(tmp_path, case):
    stage, dtype, world, model, options = case
    results = run_ranks(world, _nvme_and_plain, stage, dtype, model, options, str(tmp_path), timeout=240)
    for rank, (nvme, plain) in enumerate(results):
        assert nvme["muon"] and nvme["adam_sq"], "the model must have parameters in both groups"
        assert nvme["losses"] == plain["losses"], f"rank {rank}: losses differ"
        for key in ("params", "masters", "momentum", "adam_sq"):
            for n in plain[key]:
                assert torch.equal(nvme[key][n], plain[key][n]), f"rank {rank}: {key} of {n} differs"
        mem, muon_bytes, adam_bytes = nvme["memory"], *nvme["group_bytes"]
        copies = 2  # on the drive each sub-group's state is twice: its spare file (docs/memory.md)
        assert mem["fp32_master"]["nvme"] == copies * (muon_bytes + adam_bytes), mem
        assert mem["fp32_master"]["host"] == 0, mem
        assert (mem["params"]["nvme"] > 0) == bool(options.get("param_nvme")), mem
        if options.get("memory"):  # the momentum counted where it lives; Adam's moments stay on NVMe
            assert mem["optimizer_state"]["nvme"] == copies * 2 * adam_bytes, mem
            assert mem["optimizer_state"]["host"] == muon_bytes, mem
        else:
            assert mem["optimizer_state"]["nvme"] == copies * (muon_bytes + 2 * adam_bytes), mem
            assert mem["optimizer_state"]["host"] == 0, mem


def _checkpoints_cross(stage, options, nvme_path, ckpt):
    """An NVMe run's checkpoint loaded without offload, and a checkpoint without offload loaded by an NVMe
    run, each trained on: both must continue as a run without offload resumed from its own checkpoint."""
    options = dict(options)
    memory = options.pop("memory", False)
    nvme = {"device": "nvme", "nvme_path": nvme_path, **options}
    _train(stage, "fp32", "gpt", nvme, memory, save_to=f"{ckpt}/nvme")
    _train(stage, "fp32", "gpt", None, save_to=f"{ckpt}/plain")
    return (_train(stage, "fp32", "gpt", None, load_from=f"{ckpt}/nvme"),
            _train(stage, "fp32", "gpt", nvme, memory, load_from=f"{ckpt}/plain"),
            _train(stage, "fp32", "gpt", None, load_from=f"{ckpt}/plain"))


@pytest.mark.parametrize("stage, options", [(3, {"pipeline_read": True}), (2, {"sliced": True, "memory": True})],
                         ids=["z3", "z2-sliced-memory"])
def test_checkpoints_carry_the_momentum_to_and_from_nvme_runs(tmp_path, stage, options):
    results = run_ranks(2, _checkpoints_cross, stage, options, str(tmp_path / "nvme"), str(tmp_path / "ckpt"),
                        timeout=240)
    for from_nvme, into_nvme, plain in results:
        for key in ("params", "momentum", "adam_sq"):
            for n in plain[key]:
                assert torch.equal(from_nvme[key][n], plain[key][n]), f"NVMe checkpoint: {key} of {n}"
                assert torch.equal(into_nvme[key][n], plain[key][n]), f"loaded by an NVMe run: {key} of {n}"


def _full_drive_stops_the_engine(swap, full):
    import errno

    import zero_ext
    from zero_ext.config.errors import EngineUsageError
    from helpers.fs import lose_reservation

    torch.manual_seed(0)
    model = MODELS["gpt"]()
    offload = {"device": "nvme", "nvme_path": swap, "sliced": True}
    engine = zero_ext.initialize(model=model, config=_config(2, "fp32", offload))[0]
    gen = torch.Generator().manual_seed(3)
    engine.backward(engine.module.loss(MODELS["gpt"].batch(2, gen)))
    engine.step()
    engine.backward(engine.module.loss(MODELS["gpt"].batch(2, gen)))
    store = engine.optimizer.nvme
    victim = store._groups[store.keys()[1]]  # the step's first pass writes it after the first group
    lose_reservation(store.swapper._files[victim.spare], full)
    out = {}
    try:
        engine.step()
    except OSError as exc:
        out["error"] = (exc.errno == errno.ENOSPC, getattr(exc, "rolled_back", False))
    try:  # nothing more runs: the state on the drive is half of a step
        engine.step()
    except EngineUsageError as exc:
        out["next"] = str(exc)
    engine.destroy()
    return out


def test_a_full_drive_in_muons_streamed_step_stops_the_engine_by_name(tmp_path, mounts):
    """Muon's NVMe step is not a transaction (docs/nvme.md): a write that fails in it is the named OSError,
    and the engine then refuses to go on, saying why and what to do, instead of training on a state half
    written."""
    from helpers.fs import mount

    full = mount(tmp_path, "tmpfs", "size=64k")
    mounts.append(full)
    (tmp_path / "swap").mkdir()
    out = run_ranks(1, _full_drive_stops_the_engine, str(tmp_path / "swap"), str(full), timeout=120)[0]
    assert out["error"] == (True, False), out
    assert "cannot continue" in out["next"] and ("ENOSPC" in out["next"] or "No space" in out["next"]), out
    assert "load the last checkpoint" in out["next"], out
