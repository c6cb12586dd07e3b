"""The compatibility package's import surface (issue 20): the DeepSpeed paths and names that Lightning,
PEFT, TRL and scripts import, each resolving to zero_ext's code, with DeepSpeed's behaviour where it has
one. The checkout's compat/ is imported (first on sys.path), whatever `deepspeed` is installed."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from helpers.compat_site import import_checkout_compat
from helpers.harness import run_ranks

COMPAT = os.path.join(ROOT, "compat")


@pytest.fixture(scope="module")
def ds():
    """The checkout's `deepspeed` package (an installed copy of another checkout is set aside)."""
    return import_checkout_compat()


def test_utils_logging_is_deepspeeds_module_with_the_zero_ext_logger(ds):
    import logging

    import deepspeed.utils.logging as ds_logging

    assert ds.utils.logging is ds_logging and ds.utils.logging is not logging
    ds.utils.logging.logger.setLevel(logging.INFO)  # what Lightning's DeepSpeedStrategy does
    assert ds.utils.logger is ds_logging.logger is logging.getLogger("zero_ext")
    logging.getLogger("zero_ext").setLevel(logging.NOTSET)


def test_submodules_import_by_statement_in_a_fresh_process():
    code = ("from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_optim_files, "
            "get_model_state_file\n"
            "from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_name\n"
            "from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum\n"
            "from deepspeed.runtime.zero.offload_states import get_state_devices\n"
            "from deepspeed.runtime.zero.tiling import TiledLinear\n"
            "from deepspeed.runtime.zero import ZeroParamStatus, TiledLinear as _T\n"
            "from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig\n"
            "from deepspeed.runtime.config import DeepSpeedConfig\n"
            "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live\n"
            "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold\n"
            "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n"
            "from deepspeed.comm import new_group, all_gather_into_tensor, reduce_scatter_tensor\n"
            "from deepspeed.runtime.activation_checkpointing.checkpointing import configure, checkpoint\n"
            "import deepspeed, zero_ext\n"
            "assert deepspeed.checkpointing.checkpoint is zero_ext.checkpointing.checkpoint is checkpoint\n"
            "assert not deepspeed.checkpointing.is_configured() and deepspeed.checkpointing.reset() is None\n"
            "assert deepspeed.DeepSpeedConfigError is zero_ext.config.ConfigError\n"
            "assert deepspeed.DeepSpeedConfig is deepspeed.runtime.config.DeepSpeedConfig\n"
            "assert get_optim_files is zero_ext.checkpoint.zero_to_fp32.get_optim_files\n"
            "print(deepspeed.__file__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([COMPAT, ROOT])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(COMPAT)


def test_git_hash_names_the_checkout(ds):
    assert isinstance(ds.__git_hash__, str) and ds.__git_hash__
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert ds.__git_hash__ == head.stdout.strip()


def test_checkpoint_file_helpers(tmp_path):
    from zero_ext.utils.zero_to_fp32 import get_model_state_file, get_optim_files

    with pytest.raises(FileNotFoundError, match="no \\*_optim_states.pt"):
        get_optim_files(str(tmp_path))
    for r in (10, 2, 0, 1):
        (tmp_path / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    names = [os.path.basename(f) for f in get_optim_files(str(tmp_path))]
    assert [n.split("_")[4] for n in names] == ["0", "1", "2", "10"]  # rank order, not string order
    other = tmp_path / "other"  # as DeepSpeed's: any *_optim_states.pt name, in natural order
    other.mkdir()
    for i in (12, 1, 0, 2):
        (other / f"zero_{i}_optim_states.pt").write_bytes(b"")
    assert [os.path.basename(f) for f in get_optim_files(str(other))] == [
        f"zero_{i}_optim_states.pt" for i in (0, 1, 2, 12)]
    with pytest.raises(FileNotFoundError, match="model states"):
        get_model_state_file(str(tmp_path), 2)
    (tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    assert get_model_state_file(str(tmp_path), 3).endswith("zero_pp_rank_0_mp_rank_00_model_states.pt")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    for stage in (1, 3):
        assert get_model_state_file(str(tmp_path), stage).endswith(os.sep + "mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError):
        get_optim_files(str(tmp_path / "absent"))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 2)


def test_leaf_modules_by_class_name_and_suffix(ds):
    from deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                                 set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules)

    net = Net()
    with pytest.raises(ValueError, match="no module of the classes"):
        set_z3_leaf_modules(net, [torch.nn.Conv2d])
    assert set_z3_leaf_modules(net, [torch.nn.Conv2d], raise_if_not_found=False) == []
    assert set_z3_leaf_modules(net, ["Block"]) == list(net.blocks)
    assert unset_z3_leaf_modules(net, [Block]) == list(net.blocks) and get_z3_leaf_modules(net) == []

    found, missing = set_z3_leaf_modules_by_name(net, ["blocks.1", "nope"], raise_if_not_found=False)
    assert found == [net.blocks[1]] and missing == ["nope"] and get_z3_leaf_modules(net) == [net.blocks[1]]
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(net, ["blocks.0", "nope"])
    assert not ds.utils.z3_leaf_module(net.blocks[0])  # a refused call changes nothing
    found, missing = set_z3_leaf_modules_by_name(net, ["blocks.1"], flag=False)
    assert found == [net.blocks[1]] and missing == [] and get_z3_leaf_modules(net) == []

    found, missing = set_z3_leaf_modules_by_suffix(net, ["down", "1.down", "head"])
    assert found == [net.blocks[0].down, net.blocks[1].down, net.head] and missing == []  # each module once
    with pytest.raises(ValueError, match="zzz"):
        set_z3_leaf_modules_by_suffix(net, ["zzz"])
    assert set_z3_leaf_modules_by_suffix(net, ["zzz", "up"], raise_if_not_found=False)[1] == ["zzz"]
    assert len(get_z3_leaf_modules(net)) == 5


def test_moe_group_splitter_moves_expert_params_into_their_own_groups(ds):
    from deepspeed.moe.utils import is_moe_param_group, split_params_into_different_moe_groups_for_optimizer as split

    net = Net()
    group = {"params": net.head.parameters(), "name": "head", "lr": 0.1}  # a generator becomes a list
    out = split(group)
    assert out == [group] and out[0]["params"] == list(net.head.parameters()) and out[0]["lr"] == 0.1
    groups = ({"params": list(net.blocks.parameters())}, {"params": [net.head.weight], "weight_decay": 0.0})
    out = split(groups, max_group_size=3)
    assert isinstance(out, list) and len(out) == 2 and out[1]["params"] == [net.head.weight]
    with pytest.raises(ValueError):
        split("params")
    up, down = net.blocks[1].up, net.blocks[1].down
    for p in (up.weight, down.weight):  # DeepSpeed's marks of an expert parameter
        p.allreduce, p.group_name = False, "ep_size_2"
    dense = [p for p in net.blocks.parameters() if p is not up.weight and p is not down.weight]
    out = split([{"params": list(net.head.parameters())}, {"params": list(net.blocks.parameters()),
                                                           "name": "blocks", "lr": 0.5}])
    assert [g.get("name") for g in out] == [None, "blocks", "ep_size_2"] and not is_moe_param_group(out[1])
    assert out[1]["params"] == dense and out[2]["params"] == [up.weight, down.weight]
    assert out[2]["moe"] is True and out[2]["lr"] == 0.5 and is_moe_param_group(out[2])
    cap = up.weight.numel()  # each expert group is cut into runs of at most max_group_size elements
    out = split([{"params": list(net.blocks.parameters()), "name": "blocks"}], max_group_size=cap)
    assert [g["params"] for g in out[1:]] == [[up.weight], [down.weight]]
    up.weight.allreduce = down.weight.allreduce = True  # marked but reduced over all ranks: ordinary ones
    assert len(split([{"params": list(net.blocks.parameters())}])) == 1


def test_deepspeed_config_from_dict_path_and_base64(ds, tmp_path):
    import base64
    import json

    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                               DeepSpeedZeroOffloadParamConfig)

    raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 7,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    for source in (raw, str(path), base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()):
        cfg = DeepSpeedConfig(source)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
        assert cfg.world_size == 1 and cfg.zero_optimization_stage == 3 and cfg.zero_enabled
        assert cfg.bfloat16_enabled and not cfg.fp16_enabled and cfg.steps_per_print == 7
        assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 1e-3}
        assert isinstance(cfg.zero_config, DeepSpeedZeroConfig)
        assert isinstance(cfg.zero_config.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
        assert cfg._param_dict == raw
    assert raw["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}  # not modified

    class MPU:
        def get_data_parallel_world_size(self):
            return 2
    assert DeepSpeedConfig({"train_batch_size": 16, "gradient_accumulation_steps": 2}, mpu=MPU()
                           ).train_micro_batch_size_per_gpu == 4
    with pytest.raises(DeepSpeedConfigError, match="zero_optimisation"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimisation": {"stage": 2}})  # misspelt: refused
    with pytest.raises(AttributeError, match="runtime/config.py"):
        DeepSpeedConfig({"train_batch_size": 1}).no_such_thing
    z = DeepSpeedZeroConfig(stage=3, offload_param={"device": "cpu"})
    assert z.stage == 3 and isinstance(z.offload_param, DeepSpeedZeroOffloadParamConfig)


def test_accelerator_dtypes_memory_and_cpu_device_count(ds, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert torch.float32 in acc.supported_dtypes() and torch.float16 in acc.supported_dtypes()
    assert acc.memory_allocated() >= 0 and acc.max_memory_allocated() >= acc.memory_allocated() - 1
    assert acc.total_memory() > 0 and 0 < acc.available_memory() <= acc.total_memory()
    if acc.device_name() == "cpu":
        before = acc.memory_allocated()
        big = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
        assert acc.memory_allocated() >= before + 32 * 2 ** 20
        del big
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        assert acc.device_count() == 3
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        monkeypatch.delenv("LOCAL_SIZE", raising=False)
        assert acc.device_count() == 1
    # what current_device() answers is a device torch takes: tensors made on it live where the engine computes
    assert torch.zeros(1, device=acc.current_device()).device == torch.device(acc.current_device_name())
    # DeepSpeed's tensor constructors: values on this device, in the named dtype
    made = {name: getattr(acc, name)([1, 2]) for name in ("FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor",
                                                            "ByteTensor", "IntTensor", "LongTensor")}
    assert [t.dtype for t in made.values()] == [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                torch.uint8, torch.int32, torch.int64]
    assert all(t.tolist() == [1, 2] and t.device.type == acc.device_name() for t in made.values())


def _groups_and_gather():
    import zero_ext.comm as comm

    rank, world = comm.get_rank(), comm.get_world_size()
    group = comm.new_group([0, 1])
    out = torch.empty(2 * world)
    comm.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=group)
    return out.tolist(), comm.get_process_group_ranks(group), comm.get_world_size(group), comm.get_rank(group)


def test_comm_groups_and_all_gather_into_tensor(ds):
    import zero_ext.comm

    assert ds.comm.new_group is zero_ext.comm.new_group is torch.distributed.new_group
    for rank, (gathered, ranks, size, grank) in enumerate(run_ranks(2, _groups_and_gather, timeout=60)):
        assert gathered == [0.0, 0.0, 1.0, 1.0] and ranks == [0, 1] and size == 2 and grank == rank


class _Adapted(torch.nn.Module):
    """A frozen base linear with a trainable low-rank adapter beside it (LoRA's shape, without PEFT)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.lora_a, self.lora_b = torch.nn.Linear(8, 2, bias=False), torch.nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def _save_adapted_zero3(out):
    """Two Adam steps at ZeRO-3 on 2 ranks, a checkpoint saved; the full fp32 masters of the trained
    parameters and the frozen ones' values, as the converter must give them back."""
    import zero_ext

    engine, *_ = zero_ext.initialize(model=_Adapted(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}}})
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8, generator=gen)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(out)
    want = {n: zero_ext.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()
            if p.requires_grad}
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        want.update({n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad})
    engine.destroy()
    return want


def test_peft_recovery_line_rebuilds_a_zero3_checkpoint(tmp_path):
    """HF's and PEFT's docs recover a model from a ZeRO-3 checkpoint with
    ``from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint`` and
    ``model.load_state_dict``: run as written, in a fresh process with only the compat package."""
    want = run_ranks(2, _save_adapted_zero3, str(tmp_path / "ckpt"))[0]
    torch.save(want, tmp_path / "want.pt")
    code = ("import sys, torch\n"
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
            f"state_dict = get_fp32_state_dict_from_zero_checkpoint({str(tmp_path / 'ckpt')!r})\n"
            "from test_compat_surface import _Adapted\n"
            "model = _Adapted()\n"
            "model.load_state_dict(state_dict)\n"  # strict: every key there, none extra
            f"want = torch.load({str(tmp_path / 'want.pt')!r})\n"
            "got = dict(model.named_parameters())\n"
            "bad = [n for n in want if not torch.equal(got[n].detach(), want[n])]\n"
            "assert not bad and set(want) == set(got), bad\n"
            "print(sorted(state_dict))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([COMPAT, ROOT, os.path.join(ROOT, "tests")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "lora_a.weight" in done.stdout and "base.weight" in done.stdout


def test_build_info_and_which_ops_exist(ds, tmp_path):
    import deepspeed.git_version_info as info
    from deepspeed.accelerator import is_current_accelerator_supported
    from deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    from deepspeed.utils.torch import required_torch_version

    ops = ds.ops.__compatible_ops__
    assert ops[CPUAdamBuilder.NAME] and ops[AsyncIOBuilder.NAME] and CPUAdamBuilder().is_compatible()
    assert ops[FusedAdamBuilder.NAME] and FusedAdamBuilder().is_compatible()  # zero_ext's FusedAdam
    assert not ops[FusedLambBuilder.NAME] and not FusedLambBuilder().is_compatible()  # a CUDA kernel of DeepSpeed's
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdam"):
        CPUAdamBuilder().load()
    assert info.installed_ops == ops and info.version == ds.__version__ and info.git_hash == ds.__git_hash__
    major, minor = (int(x) for x in info.torch_info["version"].split("."))
    assert (major, minor) == tuple(int(x) for x in torch.__version__.split(".")[:2])
    if torch.version.cuda:  # the NCCL torch was built with, known without a GPU (DeepSpeed's bf16 test gate reads it)
        assert info.torch_info["nccl_version"] == ".".join(str(x) for x in torch.cuda.nccl.version()[:2])
    assert is_current_accelerator_supported()
    assert required_torch_version(min_version=2.4) and not required_torch_version(max_version="1.13")
    assert required_torch_version(min_version=torch.__version__.split("+")[0], max_version="99")
    with pytest.raises(ValueError, match="min_version"):
        required_torch_version()
    assert get_model_ckpt_name_for_rank("d", "00") == os.path.join("d", "mp_rank_00_model_states.pt")
    assert get_zero_ckpt_name_for_rank("d", 3, 0) == os.path.join("d", "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in DEFAULT_LEAF_MODULE_CLASSES


def _optimizer_classes(stage, fp32_accumulation=False):
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    extra = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}} if fp32_accumulation else {}
    engine, opt, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, **extra})
    out = (isinstance(opt, DeepSpeedZeroOptimizer), isinstance(opt, DeepSpeedZeroOptimizer_Stage3),
           isinstance(opt, BF16_Optimizer), isinstance(torch.zeros(1), DeepSpeedZeroOptimizer))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_optimizer_classes_match_by_stage(ds, stage):
    [(zero12, zero3, bf16, other)] = run_ranks(1, _with_compat, _optimizer_classes, stage)
    assert (zero12, zero3, bf16, other) == (stage in (1, 2), stage == 3, False, False)


def test_bf16_at_stage_1_accumulating_in_fp32_is_deepspeeds_bf16_optimizer(ds):
    [(zero12, zero3, bf16, _)] = run_ranks(1, _with_compat, _optimizer_classes, 1, True)
    assert (zero12, zero3, bf16) == (False, False, True)  # (DeepSpeed's BF16_Optimizer is not its ZeRO-1/2 class)


def _with_compat(fn, *args):
    """Runs fn on a rank that imports this checkout's deepspeed (the workers never imported another)."""
    if COMPAT not in sys.path:
        sys.path.insert(0, COMPAT)
    return fn(*args)
