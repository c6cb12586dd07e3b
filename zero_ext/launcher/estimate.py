"""``zero-ext estimate``: the ZeRO-2 and ZeRO-3 memory tables for a model and cluster shape, and a plot.

    zero-ext estimate --params 7e9 --largest_layer_params 2e8 --num_gpus 8 --num_nodes 2
    zero-ext estimate --model mypkg.models:build --num_gpus 4 --plot mem.png

``--model module:callable`` builds the model (on torch's meta device, so no memory is used) and counts
its parameters; ``--plot FILE.png`` draws bytes per rank, accelerator and host, for each stage and offload
choice (needs matplotlib). The numbers are zero_ext's (zero_ext/utils/estimate.py explains them).
"""
import argparse
import importlib
import sys
from typing import List

from ..utils import estimate as est


def parse(argv: List[str]):
    p = argparse.ArgumentParser(prog="zero-ext estimate", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="total parameters (e.g. 7e9)")
    what.add_argument("--model", help="module:callable returning the nn.Module (built on the meta device)")
    p.add_argument("--largest_layer_params", "--largest-layer-params", type=float, default=None,
                   help="parameters of the largest layer (with --params; default: total / 100)")
    p.add_argument("--num_gpus", "--num_gpus_per_node", dest="num_gpus", type=int, default=1, help="ranks per node")
    p.add_argument("--num_nodes", type=int, default=1)
    p.add_argument("--stage", type=int, choices=(2, 3), default=None, help="only this stage's table")
    p.add_argument("--buffer_factor", "--additional_buffer_factor", dest="buffer_factor", type=float, default=1.5,
                   help="factor on the per-CPU column (DeepSpeed's additional_buffer_factor)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw bytes per rank by stage and offload")
    return p.parse_args(argv)


def _build(spec: str):
    import torch

    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"zero-ext estimate: --model wants module:callable, got {spec!r}")
    factory = getattr(importlib.import_module(module), attr)
    with torch.device("meta"):
        return factory()


def plot(path: str, total_params: float, largest_layer_params: float, num_gpus: int, num_nodes: int) -> None:
    """Bars of bytes per rank (accelerator, host) for each configuration of estimate.CONFIGURATIONS."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("zero-ext estimate --plot needs matplotlib, which is not installed: "
                         f"{sys.executable} -m pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = est.per_rank_bytes(total_params, largest_layer_params, num_gpus * num_nodes)
    labels = list(rows)
    acc = [rows[k].accelerator / est.GiB for k in labels]
    host = [rows[k].host_states / est.GiB for k in labels]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar([x - 0.2 for x in xs], acc, 0.4, label="accelerator (per rank)")
    ax.bar([x + 0.2 for x in xs], host, 0.4, label="host (per rank)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GiB")
    ax.set_title(f"model states per rank: {total_params / 1e6:.0f}M params, {num_nodes} x {num_gpus} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: List[str]) -> int:
    args = parse(argv)
    if args.num_gpus < 1 or args.num_nodes < 1:
        raise SystemExit("zero-ext estimate: --num_gpus and --num_nodes must be >= 1")
    if args.model:
        total, largest = est.model_to_params(_build(args.model))
    else:
        total = int(args.params)
        largest = int(args.largest_layer_params if args.largest_layer_params is not None else total / 100)
    if args.stage in (None, 2):
        print(est.zero2_table(total, args.num_gpus, args.num_nodes, args.buffer_factor))
    if args.stage in (None, 3):
        print(est.zero3_table(total, largest, args.num_gpus, args.num_nodes, args.buffer_factor))
    if args.plot:
        plot(args.plot, total, largest, args.num_gpus, args.num_nodes)
        print(f"plot written to {args.plot}")
    return 0
