"""zero.Init: partitioning at construction, rank 0's values, Module.apply, and torch left unpatched.

Every rank seeds differently (7 + 100 * rank); the reference is the same construction without Init
under rank 0's seed (7). Init must give every rank exactly the reference, in pieces.
"""
import copy

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.models import TinyGPT
from helpers.zero3 import Deep, Shared, full_values, rank, same_tensors


class GrandPa(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_grandpa = nn.Parameter(torch.ones(5))
        self.param_grandpa.data = self.param_grandpa.data + 1


class Pa(GrandPa):
    def __init__(self):
        super().__init__()
        self.param_pa = nn.Parameter(torch.ones(5))
        self.param_pa.data = self.param_pa.data + 1
        self.param_grandpa.data = self.param_grandpa.data + 1


class Son(Pa):
    """Each subclass __init__ edits what its bases registered: all edits happen before partitioning."""

    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.ones(5))
        self.param.data = self.param.data + 1
        self.param_pa.data = self.param_pa.data + 1
        self.param_grandpa.data = self.param_grandpa.data + 1


class LateParams(nn.Module):
    """A parent registers a parameter on an already built child, initialises it, and registers it again
    under another name."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(3, 4)
        self.child.extra = nn.Parameter(torch.empty(7))
        nn.init.normal_(self.child.extra)
        self.alias = self.child.extra  # the same pending parameter registered twice
        self.after = nn.Linear(4, 2)


def _build_all():
    """Every construction pattern, each under its own seed (same on the reference)."""
    models = {}
    for i, (name, make) in enumerate([("deep", Deep), ("gpt", TinyGPT), ("son", Son), ("late", LateParams),
                                      ("shared", Shared)]):
        torch.manual_seed(7 + 100 * rank() + i)
        models[name] = make()
    torch.manual_seed(11 + 100 * rank())
    top = nn.Linear(3, 3)
    top.extra = nn.Parameter(torch.empty(4))  # registered after construction, outside any constructor
    nn.init.normal_(top.extra)
    models["top"] = top
    return models


def _construction(world):
    import zero_ext.zero as zero

    if rank() == 0:
        reference = {name: {n: p.detach().clone() for n, p in m.named_parameters()}
                     for name, m in _build_all().items()}
    with zero.Init():
        models = _build_all()
        early = zero.is_zero_param(models["deep"].blocks[0].fc1.weight)  # done before Init's exit
    out = {"early": early, "plain": [], "shapes": {}, "pieces": {}}
    for name, model in models.items():
        for n, p in model.named_parameters():
            if not zero.is_zero_param(p):
                out["plain"].append(f"{name}.{n}")
            else:
                out["shapes"][f"{name}.{n}"] = (tuple(p.shape), tuple(p.ds_shape), p.ds_tensor.numel(),
                                                 p.ds_status.name)
    out["values"] = {name: full_values(m) for name, m in models.items()}
    deep = models["deep"]
    out["buffer"] = (zero.is_zero_param(deep.shift), torch.equal(deep.shift, torch.linspace(-1, 1, 6)))
    out["shared"] = models["shared"].a.weight is models["shared"].b.weight
    if rank() == 0:
        out["reference"] = reference
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_construction_equals_rank0_seeded_plain_construction(world):
    results = run_ranks(world, _construction, world)
    reference = results[0]["reference"]
    for r, res in enumerate(results):
        assert res["early"], "a module is partitioned once the next allocation shows its constructor returned"
        assert res["plain"] == []
        assert res["buffer"] == (False, True) and res["shared"]
        for name in reference:
            assert same_tensors(reference[name], res["values"][name]) == [], f"rank {r}: {name}"
        for key, (shape, ds_shape, piece, status) in res["shapes"].items():
            numel = torch.Size(ds_shape).numel()
            assert shape == (0,) and status == "NOT_AVAILABLE", key
            assert piece == -(-numel // world), key
    son = reference["son"]
    assert [son[n][0].item() for n in ("param_grandpa", "param_pa", "param")] == [4.0, 3.0, 2.0]


# -- Module.apply ----------------------------------------------------------------------------------------

class Parent(nn.Module):
    """Initialises its (already partitioned) children through self.apply, differently on each rank."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(12, 1)
        self.own = nn.Parameter(torch.zeros(3))
        self.apply(self._init)

    @staticmethod
    def _init(m):
        value = 1.0 + rank()
        if isinstance(m, nn.Linear):
            m.weight.data.fill_(value)
            m.bias.data.fill_(-value)
        elif isinstance(m, Parent):
            m.own.data.fill_(value)


def _apply(config):
    import zero_ext.zero as zero

    with zero.Init(config_dict_or_path=config):
        model = Parent()
    pieces = {n: p.ds_tensor.tolist() for n, p in model.named_parameters()}
    try:  # outside Init the pieces are empty tensors: writing to them is refused
        model.apply(Parent._init)
        refused = ""
    except zero.PartitionedWriteError as exc:
        refused = str(exc)
    after = {n: p.ds_tensor.tolist() for n, p in model.named_parameters()}
    return pieces, after, refused


@pytest.mark.parametrize("override", [True, False])
def test_module_apply_in_a_parent_constructor_keeps_rank0_writes(override):
    # override_module_apply no longer matters: the writes reach the full parameters either way
    config = {"zero_optimization": {"stage": 3, "override_module_apply": override}}
    for r, (pieces, after, refused) in enumerate(run_ranks(2, _apply, config)):
        assert after == pieces
        # rank 0's values (3 elements: rank 1 has a pad)
        assert pieces["own"] == ([1.0, 1.0] if r == 0 else [1.0, 0.0])
        assert pieces["child.weight"] == [1.0] * 6 and pieces["child.bias"] == ([-1.0] if r == 0 else [0.0])
        assert "fill_" in refused and "Linear.weight" in refused and "GatheredParameters" in refused


# -- torch left as it was --------------------------------------------------------------------------------

def _namespaces():
    import torch.nn.functional as F
    from torch.nn.modules import module

    spaces = {"torch": vars(torch), "F": vars(F), "Module": vars(nn.Module), "Tensor": vars(torch.Tensor),
              "Parameter": vars(nn.Parameter), "TensorBase": vars(torch._C.TensorBase)}
    snapshot = {f"{s}.{k}": id(v) for s, d in spaces.items() for k, v in list(d.items())}
    hooks = {name: len(getattr(module, name)) for name in dir(module) if name.startswith("_global_")
             and isinstance(getattr(module, name), dict)}
    return snapshot, hooks, torch._C._len_torch_function_stack()


def _unpatched():
    import zero_ext.zero as zero

    before = _namespaces()
    with zero.Init():
        inside = _namespaces()
        nn.Linear(2, 2)
    after_ok = _namespaces()
    try:
        with zero.Init(), zero.Init():  # nested, and left by an exception
            nn.Linear(2, 2)
            raise KeyError("in the with block")
    except KeyError:
        pass
    after_error = _namespaces()
    changed_inside = sorted(k for k in before[0] if inside[0].get(k) != before[0][k])
    return before == after_ok == after_error, changed_inside, inside[2], inside[1] != before[1]


def test_torch_is_unpatched_after_init():
    unpatched, changed_inside, modes_inside, hooks_inside = run_ranks(2, _unpatched)[0]
    assert changed_inside == []  # Init patches nothing, even while active
    assert modes_inside == 1 and hooks_inside
    assert unpatched


# -- options ---------------------------------------------------------------------------------------------

def _options():
    import zero_ext.zero as zero

    out = {}
    with zero.Init(enabled=False):
        out["disabled"] = zero.is_zero_param(nn.Linear(2, 2).weight)
    torch.manual_seed(100 * rank())
    built = nn.Linear(5, 3)
    zero.Init(module=built)  # an existing model: rank 0's values
    torch.manual_seed(0)
    out["module"] = same_tensors(full_values(built), {n: p.detach() for n, p in nn.Linear(5, 3).named_parameters()})
    with zero.Init(remote_device="cpu", dtype=torch.bfloat16):
        m = nn.Linear(3, 3)
    out["remote"] = (m.weight.ds_tensor.device.type, m.weight.ds_tensor.dtype, m.weight.dtype)
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with zero.Init(config_dict_or_path=cfg):
        m = nn.Linear(3, 3)
        buf = torch.arange(3)
    out["config"] = (m.weight.ds_tensor.device.type, m.weight.dtype, buf.dtype)

    @zero.Init()
    def make():
        return nn.Linear(4, 4)

    out["decorator"] = [zero.is_zero_param(make().weight), zero.is_zero_param(make().weight)]
    with zero.Init():
        with zero.Init(remote_device="cpu"):  # nested: the outer context's settings apply
            inner = nn.Linear(2, 2)
            inner.late = nn.Parameter(torch.zeros(2))
        out["nested"] = (zero.is_zero_param(inner.weight), zero.is_zero_param(inner.late))
    out["nested_exit"] = zero.is_zero_param(inner.late)
    for kwargs in ({"remote_device": "nvme"}, {"zero_quantized_weights": True}, {"dtype": torch.float64}):
        try:
            zero.Init(**kwargs)
            out[str(kwargs)] = "no error"
        except (NotImplementedError, ValueError) as exc:
            out[str(kwargs)] = type(exc).__name__
    return out


def test_init_options():
    for out in run_ranks(2, _options):
        assert out["disabled"] is False
        assert out["module"] == []
        assert out["remote"] == ("cpu", torch.bfloat16, torch.bfloat16)
        assert out["config"] == ("cpu", torch.bfloat16, torch.int64)  # only floating tensors are cast
        assert out["decorator"] == [True, True]
        assert out["nested"] == (True, False) and out["nested_exit"] is True
        assert out["{'remote_device': 'nvme'}"] == "ValueError"  # needs offload_param.nvme_path from a config
        # qwZ is the engine's (zero_optimization.zero_quantized_weights): Init accepts the flag, as DeepSpeed's
        assert out["{'zero_quantized_weights': True}"] == "no error"
        assert out["{'dtype': torch.float64}"] == "ValueError"


def _single_rank_guard():
    import os

    import torch.distributed as dist
    import zero_ext.zero as zero

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ["WORLD_SIZE"] = "2"
    try:
        zero.Init()
        return ""
    except RuntimeError as exc:
        return str(exc)
    finally:
        os.environ["WORLD_SIZE"] = "1"


def test_single_rank_group_under_a_multi_process_launch_is_refused():
    message = run_ranks(1, _single_rank_guard, init=False)[0]
    assert "WORLD_SIZE" in message and "init_distributed" in message


# -- construction details --------------------------------------------------------------------------------

class Cloner(nn.Module):
    """Deep-copies a finished child (nn.TransformerEncoder's pattern) and one of its own parameters
    while still under construction."""

    def __init__(self, layer):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.w_copy = copy.deepcopy(self.w)  # own parameter, constructor still running: a whole copy
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(2)])


def _deepcopy_under_init():
    import zero_ext.zero as zero

    torch.manual_seed(1)
    ref = Cloner(nn.Linear(3, 2))
    torch.manual_seed(1 + rank())
    with zero.Init():
        model = Cloner(nn.Linear(3, 2))
        lin = nn.Linear(3, 3)
        # the first torch call after the constructor partitions it; under Init it still sees 3 x 3
        first_use = (lin.weight.numel(), zero.is_zero_param(lin.weight))
    plain = [n for n, p in model.named_parameters() if not zero.is_zero_param(p)]
    ids = [p.ds_id for p in model.parameters()]
    return (same_tensors({n: p.detach() for n, p in ref.named_parameters()}, full_values(model)), plain,
            len(set(ids)) == len(ids), first_use)


def test_deepcopy_of_modules_under_construction():
    for differ, plain, unique_ids, first_use in run_ranks(2, _deepcopy_under_init):
        assert differ == [] and plain == [] and unique_ids and first_use == (9, True)


class _Session:  # what the construction mode reads from an Init session
    from zero_ext.zero.materialise import Materialiser

    device = torch.device("meta")
    dtype = torch.bfloat16
    pending = []
    materialiser = Materialiser()


def test_construction_mode_places_new_tensors_and_casts_floats():
    from zero_ext.zero.init import _ConstructionMode

    source = torch.zeros(2)
    with _ConstructionMode(_Session()):
        made = [torch.empty(3), torch.randn(2), torch.tensor([1.0]), torch.arange(3), torch.zeros(2, device="cpu"),
                torch.zeros_like(source), source.new_ones(2)]
    assert [t.device.type for t in made] == ["meta", "meta", "meta", "meta", "cpu", "cpu", "cpu"]
    assert [t.dtype for t in made] == [torch.bfloat16] * 3 + [torch.int64] + [torch.bfloat16] * 3


def test_single_rank_group_error_names_the_launcher_world_and_the_fix():
    from zero_ext.zero.convert import single_rank_group_error

    message = single_rank_group_error(1, None, {"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in message and "init_distributed" in message and "data_parallel_group" in message
    for env in ({"WORLD_SIZE": "1"}, {}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "eight"}, {"WORLD_SIZE": None}):
        assert single_rank_group_error(1, None, env) is None, env  # one process, or no evidence of more
    assert single_rank_group_error(8, None, {"WORLD_SIZE": "8"}) is None  # the group shards
    assert single_rank_group_error(1, object(), {"WORLD_SIZE": "8"}) is None  # a one-rank group passed on purpose


def _init_under_a_bigger_launcher():
    import os

    from zero_ext import zero

    launched = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "4"  # (the launcher's world; this process group was initialised alone)
    try:
        with zero.Init():
            nn.Linear(4, 4)
    except RuntimeError as exc:
        return str(exc)
    finally:
        if launched is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = launched
    return None


def test_zero_init_refuses_a_one_rank_group_under_a_multi_process_launcher():
    message = run_ranks(1, _init_under_a_bigger_launcher)[0]
    assert message is not None and "WORLD_SIZE=4" in message
