"""DeepSpeed features zero_ext does not have (pipeline parallelism) keep their import paths:
modules that import the names load, building one refuses and says why. ``LayerSpec`` needs no pipeline and
works. The checkout's compat/ is imported (first on sys.path)."""
import pytest
import torch

from helpers.compat_site import import_checkout_compat


@pytest.fixture(scope="module")
def ds():
    return import_checkout_compat()


def test_a_module_subclassing_pipelinemodule_loads_and_building_it_refuses(ds):
    from deepspeed.pipe import PipelineModule

    class TwoStages(PipelineModule):  # what model files define at import time
        def __init__(self):
            super().__init__(layers=[torch.nn.Linear(2, 2)], num_stages=2)

    with pytest.raises(NotImplementedError, match="not pipeline parallelism"):
        TwoStages()


def test_layerspec_builds_its_layer_later(ds):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    spec = LayerSpec(torch.nn.Linear, 3, 5, bias=False)
    built = spec.build()
    assert isinstance(built, torch.nn.Linear) and built.weight.shape == (5, 3) and built.bias is None
    assert spec.build() is not built  # each build is a new module
    assert TiedLayerSpec("embed", torch.nn.Embedding, 7, 4).build().weight.shape == (7, 4)
    with pytest.raises(RuntimeError, match="torch.nn.Module"):
        LayerSpec(len)


def test_the_moe_layer_is_zero_exts_and_swap_tensor_has_deepspeeds_constant(ds):
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from zero_ext.moe import MoE as ours

    assert MoE is ours  # (tests/test_moe_*.py test the layer itself)
    assert MIN_SWAPPABLE_BYTES == 1 << 20
