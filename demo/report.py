"""The demo's end-of-run memory table: each rank's engine.memory_breakdown() beside one unsharded process."""
from typing import Dict, List

MiB = 2 ** 20


def unsharded_bytes(n_params: int, bf16: bool, buffers: int) -> Dict[str, int]:
    """What one process training without ZeRO holds, by kind: the model's parameters and gradients in
    its dtype, an fp32 master copy only with bf16 (fp32 parameters are their own master), and Adam's
    two fp32 moments (8 bytes per parameter)."""
    width = 2 if bf16 else 4
    return {"params": width * n_params, "fp32_master": 4 * n_params if bf16 else 0, "grads": width * n_params,
            "fp32_grads": 0, "optimizer_state": 8 * n_params, "comm_buffers": 0, "buffers": buffers}


def memory_table(rows: List[Dict[str, Dict[str, int]]], n_params: int, bf16: bool, stage: int) -> str:
    """rows[r] is rank r's memory_breakdown(): {kind: {tier: bytes}} with a "total" kind."""
    per_rank = [{kind: sum(tiers.values()) for kind, tiers in row.items()} for row in rows]
    kinds = [k for k in per_rank[0] if k != "total"]
    ref = unsharded_bytes(n_params, bf16, per_rank[0].get("buffers", 0))
    ref["total"] = sum(ref.values())
    ranks = [f"rank{r}" for r in range(len(rows))]
    lines = [f"\nmemory per rank after training, MiB (ZeRO stage {stage}; all tiers summed):",
             f"{'kind':<16}" + "".join(f"{name:>10}" for name in ranks + ["unsharded"])]
    for kind in kinds + ["total"]:
        cells = [f"{r[kind] / MiB:10.2f}" for r in per_rank]
        cells.append(f"{ref[kind] / MiB:10.2f}" if kind in ref else f"{'-':>10}")
        if kind == "total":
            lines.append("-" * (16 + 10 * (len(ranks) + 1)))
        lines.append(f"{kind:<16}" + "".join(cells))
    shares = ", ".join(f"{name} {r['total'] / ref['total']:.0%}" for name, r in zip(ranks, per_rank))
    width = 2 if bf16 else 4
    master = "fp32 master 4 + " if bf16 else ""
    lines.append(f"unsharded: one process without ZeRO, {n_params:,} params x 16 bytes = params {width} + grads "
                 f"{width} + {master}Adam m,v 8" + ("" if bf16 else " (fp32 params are their own master)"))
    lines.append(f"each rank holds {shares} of the unsharded total")
    return "\n".join(lines)
