"""``deepspeed.pipe``: the names pipeline-parallel code imports. zero_ext is data-parallel ZeRO only, so a
``PipelineModule`` cannot be built; ``LayerSpec`` (a deferred layer constructor) works, as it needs no
pipeline. Modules that only import these names (to subclass or to check types) load unchanged."""
import torch


class LayerSpec:
    """DeepSpeed's deferred layer: the class and its arguments now, the module at ``build()``."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log=False):
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self):
        return f"LayerSpec({self.typename.__name__}, args={self.module_args}, kwargs={self.module_kwargs})"


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's LayerSpec of a layer whose weights are shared by several pipeline stages."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight", ),
                 **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr


class PipelineModule(torch.nn.Module):
    """DeepSpeed's pipeline-parallel model: not in zero_ext. Subclasses may be defined; building one refuses."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.pipe.PipelineModule: zero_ext implements data-parallel ZeRO only, "
                                  "not pipeline parallelism; build the model as one torch.nn.Module "
                                  "(LayerSpec(...).build() gives each layer)")


__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule"]
