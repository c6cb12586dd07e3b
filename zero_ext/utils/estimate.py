"""ZeRO memory estimators with DeepSpeed's names, signatures and printed table, and zero_ext's bytes.

    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=1)
    estimate_zero3_model_states_mem_needs_all_cold(total_params=7e9, largest_layer_params=2e8)

What is counted: the model states (16-bit parameters, fp32 master, fp32 gradient partition, Adam's two
fp32 states) of a bf16/fp16 mixed-precision run with Adam, as zero_ext lays them out (docs/memory.md),
per rank with Ψ parameters over N ranks:

    stage 2:            accelerator 2Ψ + 16Ψ/N          host 0
    stage 2, opt cpu:   accelerator 2Ψ                  host 16Ψ/N   (master, gradients, Adam)
    stage 3:            accelerator 18Ψ/N + W           host 0
    stage 3, opt cpu:   accelerator 2Ψ/N + W            host 16Ψ/N
    stage 3, both cpu:  accelerator W                   host 18Ψ/N   (the 16-bit pieces too)

W = 4 bytes x the largest layer's parameters: one layer gathered in 16 bits plus its 16-bit gradients
while it runs backward (prefetching more layers adds to it; see zero3-guide.md). Not counted, as in
DeepSpeed's estimators: activations, stage 2's reduce buckets, persistent parameters, module buffers,
the allocator's slack. The "per CPU" column is per node: the larger of what the node's ranks keep on the
host and the loading peak (each rank building the model in fp32 on the CPU: 4Ψ per rank, or with
zero.Init only the largest layer at a time, 4 x largest layer per rank), times ``additional_buffer_factor``.

Where the numbers differ from DeepSpeed's: DeepSpeed's stage-2 estimate is 2Ψ + 18Ψ/N on the GPU (it
also keeps a 16-bit gradient partition, 2Ψ/N); its CPU column uses max(4·ranks, 16)Ψ for stage 2 offload.
"""
import math
from typing import Dict, List, NamedTuple, Tuple

GiB = 2 ** 30


class Estimate(NamedTuple):
    """One configuration's bytes: per rank on the accelerator (states + working set) and on the host."""
    accelerator_states: int   # partitioned / replicated model states kept on the accelerator
    working_set: int          # stage 3: gathered layer (W); 0 for stage 2
    host_states: int          # model states kept in host memory, per rank
    load_peak: int            # host bytes per rank while the model is built

    @property
    def accelerator(self) -> int:
        return self.accelerator_states + self.working_set


def model_to_params(model) -> Tuple[int, int]:
    """(total parameters, largest layer's parameters) of a module: tied parameters counted once; a layer
    is one module's own parameters (not its children's). Works on a model built on the meta device."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied Parameter once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def estimate(stage: int, total_params: float, largest_layer_params: float = 0, total_gpus: int = 1,
             offload_optimizer: bool = False, offload_param: bool = False, zero_init: bool = True) -> Estimate:
    """zero_ext's per-rank bytes for one stage (2 or 3) and offload choice (see the module docstring)."""
    psi, n = float(total_params), int(total_gpus)
    if n < 1:
        raise ValueError(f"total_gpus must be >= 1, got {total_gpus}")
    if stage not in (2, 3):
        raise ValueError(f"stage must be 2 or 3, got {stage}")
    if offload_param and (stage != 3 or not offload_optimizer):
        raise ValueError("offload_param needs stage 3 and offload_optimizer (as in DeepSpeed's table)")
    shard = psi / n
    params16 = 2 * psi if stage == 2 else 2 * shard
    states32 = 16 * shard  # fp32 master 4 + fp32 gradient partition 4 + Adam 8
    acc = (0 if offload_param else params16) + (0 if offload_optimizer else states32)
    host = (states32 if offload_optimizer else 0) + (params16 if offload_param else 0)
    working = 4 * int(largest_layer_params) if stage == 3 else 0
    load = 4 * (int(largest_layer_params) if (stage == 3 and zero_init) else psi)
    return Estimate(int(math.ceil(acc)), working, int(math.ceil(host)), int(load))


def _per_cpu(e: Estimate, num_gpus_per_node: int, additional_buffer_factor: float) -> int:
    return int(max(e.host_states, e.load_peak) * num_gpus_per_node * additional_buffer_factor)


# -- DeepSpeed's functions ----------------------------------------------------------------------------

def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5) -> Tuple[int, int]:
    """(bytes per CPU/node, bytes per GPU) for ZeRO-2, optimizer offloaded to the CPU or not."""
    e = estimate(2, total_params, 0, num_gpus_per_node * num_nodes, offload_optimizer=cpu_offload)
    return _per_cpu(e, num_gpus_per_node, additional_buffer_factor), e.accelerator


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5) -> Tuple[int, int, int]:
    """(bytes per CPU/node, bytes per GPU, the largest layer's working set) for ZeRO-3."""
    e = estimate(3, total_params, largest_layer_params, num_gpus_per_node * num_nodes, offload_optimizer=cpu_offload,
                 offload_param=cpu_offload and cpu_offload_params, zero_init=zero_init)
    return _per_cpu(e, num_gpus_per_node, additional_buffer_factor), e.accelerator, e.working_set


def _header(total_params, largest_layer_params, num_gpus_per_node, num_nodes) -> List[str]:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        model += f", {int(largest_layer_params / 1e6)}M largest layer params"
    return ["Estimated memory needed for params, optim states and gradients for a:",
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.", model + ".",
            "  per CPU  |  per GPU |   Options"]


def _row(cpu, gpu, options) -> str:
    return f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {options}"


def zero2_table(total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5) -> str:
    lines = _header(total_params, None, num_gpus_per_node, num_nodes)
    for off in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, off,
                                                         additional_buffer_factor)
        lines.append(_row(cpu, gpu, f"offload_optimizer={'cpu ' if off else 'none'}"))
    return "\n".join(lines)


def zero3_table(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                additional_buffer_factor=1.5) -> str:
    lines = _header(total_params, largest_layer_params, num_gpus_per_node, num_nodes)
    for off_opt, off_param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                                                num_gpus_per_node, num_nodes, off_opt, off_param,
                                                                zero_init, additional_buffer_factor)
            opts = (f"offload_param={'cpu ' if off_param else 'none'}, "
                    f"offload_optimizer={'cpu ' if off_opt else 'none'}, zero_init={int(zero_init)}")
            lines.append(_row(cpu, gpu, opts))
    return "\n".join(lines)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Prints the ZeRO-2 table for a model of ``total_params`` parameters."""
    print(zero2_table(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor))


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Prints the ZeRO-2 table for ``model`` (an nn.Module; its parameters are counted)."""
    total, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5) -> None:
    """Prints the ZeRO-3 table for a model of ``total_params`` parameters, the largest layer given."""
    print(zero3_table(total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor))


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:
    """Prints the ZeRO-3 table for ``model`` (total and largest-layer parameters counted from it)."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


CONFIGURATIONS = (  # (label, stage, offload_optimizer, offload_param): the plot's bars
    ("ZeRO-2", 2, False, False), ("ZeRO-2\nopt=cpu", 2, True, False), ("ZeRO-3", 3, False, False),
    ("ZeRO-3\nopt=cpu", 3, True, False), ("ZeRO-3\nopt+param=cpu", 3, True, True))


def per_rank_bytes(total_params, largest_layer_params, total_gpus) -> Dict[str, Estimate]:
    """Every configuration of CONFIGURATIONS, by label."""
    return {label: estimate(stage, total_params, largest_layer_params, total_gpus, oo, op)
            for label, stage, oo, op in CONFIGURATIONS}


__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold",
           "model_to_params", "estimate", "Estimate", "per_rank_bytes", "zero2_table", "zero3_table"]
