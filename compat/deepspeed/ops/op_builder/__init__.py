"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, as far as code asks them what is available.

DeepSpeed compiles each op (CPU Adam, async I/O, fused kernels, ...) on demand with a builder class;
scripts and tests ask ``deepspeed.ops.__compatible_ops__[Builder.NAME]`` or ``Builder().is_compatible()``
before using one. zero_ext builds its ops once, into zero_ext._C: the CPU optimizers and the NVMe I/O are
always there (compatible), and FusedAdam (the C Adam on host tensors, torch's fused kernel on accelerator
tensors); DeepSpeed's other CUDA kernels
never (not compatible). Nothing is compiled here:
``load()`` names the zero_ext class to use instead.
"""


class OpBuilder:
    """One DeepSpeed op: its NAME, whether zero_ext provides it, and what to use."""

    NAME = ""
    PROVIDED_BY = None  # the zero_ext / deepspeed name that provides the op, None when zero_ext has none

    def __init__(self, name=None):
        self.name = name or self.NAME

    def absolute_name(self):
        return f"deepspeed.ops.{self.NAME}"

    def is_compatible(self, verbose=False):
        return self.PROVIDED_BY is not None

    def load(self, verbose=True):
        if self.PROVIDED_BY is None:
            raise RuntimeError(f"deepspeed op '{self.NAME}' is one of DeepSpeed's compiled kernels, which zero_ext "
                               "does not have; use the torch equivalent (the DeepSpeed config's optimizer types "
                               "map onto torch's or zero_ext's)")
        raise RuntimeError(f"deepspeed op '{self.NAME}': zero_ext compiles no ops at run time; it is built into "
                           f"zero_ext._C and used through {self.PROVIDED_BY}")

    def builder(self):
        return None


def _builder(class_name, name, provided_by=None):
    return type(class_name, (OpBuilder,), {"NAME": name, "PROVIDED_BY": provided_by,
                                           "__doc__": f"DeepSpeed's {class_name} ('{name}')."})


CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", "deepspeed.ops.lion.DeepSpeedCPULion")
AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io", "the aio config section / offload to nvme")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam",
                            "deepspeed.ops.adam.FusedAdam (the C Adam on host tensors, torch's fused kernel on "
                            "accelerator tensors)")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")
CPULambBuilder = _builder("CPULambBuilder", "cpu_lamb")
GDSBuilder = _builder("GDSBuilder", "gds")
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer")
TransformerBuilder = _builder("TransformerBuilder", "transformer")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference")
SparseAttnBuilder = _builder("SparseAttnBuilder", "sparse_attn")
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn")

ALL_OPS = {b.NAME: b() for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, AsyncIOBuilder, FusedAdamBuilder,
                                 FusedLambBuilder, FusedLionBuilder, CPULambBuilder, GDSBuilder, QuantizerBuilder,
                                 TransformerBuilder, InferenceBuilder, SparseAttnBuilder, RandomLTDBuilder,
                                 EvoformerAttnBuilder)}
