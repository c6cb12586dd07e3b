"""`make demo`: a character-level GPT learns demo/corpus.txt on 2 CPU processes through zero_ext.

    python -m torch.distributed.run --standalone --nproc_per_node 2 demo/train_gpt.py [--stage N] [--steps N]

The ZeRO stage defaults to the highest one zero_ext's config accepts, so a stage that lands later is
picked up without editing this file. Rank 0 shows a progress bar and prints the loss and tokens/s;
at the end it prints every rank's memory by kind next to what one unsharded process would hold, then
a sample from the model. Every rank runs the evaluation and the sampling too: with parameters
partitioned (stage 3) a forward pass needs all ranks.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import zero_ext
from zero_ext.config import UnimplementedFeatureError, reject_unimplemented

from data import CharCorpus
from model import GPT, count_params, lm_loss
from report import memory_table

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=None, help="ZeRO stage (default: the highest zero_ext accepts)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=128, help="characters per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters with fp32 masters (default fp32)")
    p.add_argument("--log-every", type=int, default=25, help="print a line every N steps (the bar shows each)")
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpoint", default=None,
                   help="folder: resume from its latest checkpoint if there is one, and save one at the end")
    return p.parse_args()


def ds_config(stage: int, args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps, "warmup_num_steps": 30,
                                                           "warmup_type": "linear", "cos_min_ratio": 0.1}},
        # buckets of ~0.5M elements: the model is ~1.8M, so stage 2 reduces in a few buckets during
        # backward instead of holding one buffer the size of every gradient (the 5e8 default)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000,
                              "overlap_comm": True},
    }


def choose_stage(args) -> int:
    """--stage if the config accepts it, else the highest stage it accepts (3 once its entry leaves
    zero_ext.config.UNIMPLEMENTED). A refused --stage ends the run with the config's reason, once."""
    for stage in (3, 2, 1, 0) if args.stage is None else (args.stage,):
        try:
            reject_unimplemented(ds_config(stage, args))
            return stage
        except UnimplementedFeatureError as exc:
            refused = exc
    if os.environ.get("RANK", "0") == "0":
        print(f"demo: --stage {args.stage} is refused: {refused}", file=sys.stderr)
    raise SystemExit(2)


def mean_over_ranks(value: torch.Tensor, world: int) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)  # gloo has no AVG
    return value.item() / world


@torch.no_grad()
def eval_loss(engine, corpus, args, batches: int = 4) -> float:
    """Loss on the held-out tail of the corpus; the same windows on every rank."""
    gen = torch.Generator().manual_seed(args.seed)
    total = 0.0
    for _ in range(batches):
        idx, target = corpus.batch("val", args.batch, args.block, gen)
        total += lm_loss(engine(idx), target).item()
    return total / batches


def train(engine, corpus, args, rank, world):
    # each rank reads its own windows; a resumed run continues with new ones
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 7919 * engine.global_steps)
    tokens = world * args.batch * args.block
    bar = tqdm(range(args.steps), disable=rank != 0, dynamic_ncols=True, desc="train")
    first = last = None
    window_start, window_steps = time.perf_counter(), 0
    for step in bar:
        t0 = time.perf_counter()
        idx, target = corpus.batch("train", args.batch, args.block, gen)
        loss = lm_loss(engine(idx), target)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        last = mean_over_ranks(loss, world)
        first = last if first is None else first
        window_steps += 1
        bar.set_postfix(loss=f"{last:.3f}", tok_s=f"{tokens / dt:,.0f}")
        if rank == 0 and (step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps):
            rate = tokens * window_steps / (time.perf_counter() - window_start)
            tqdm.write(f"step {step + 1:4d}  loss {last:.4f}  {rate:8,.0f} tokens/s  lr {engine.get_lr()[0]:.2e}")
            window_start, window_steps = time.perf_counter(), 0
    return first, last


def sample(gpt, corpus, args, prompt: str = "The optimizer ") -> str:
    """The same text on every rank: one seed, and every rank's forward pass (stage 3 needs them all)."""
    gen = torch.Generator().manual_seed(args.seed)
    ids = gpt.generate(torch.tensor([corpus.encode(prompt)]), args.sample_chars, generator=gen)
    return corpus.decode(ids[0].tolist())


def main():
    args = parse_args()
    torch.set_num_threads(1)
    stage = choose_stage(args)
    zero_ext.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    corpus = CharCorpus(os.path.join(HERE, "corpus.txt"))
    torch.manual_seed(args.seed)
    config = ds_config(stage, args)
    # ZeRO-3: each module's parameters are partitioned as its constructor returns, so no rank ever
    # holds the whole model (zero.Init is a no-op context below stage 3)
    with zero_ext.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        gpt = GPT(corpus.vocab_size, d=192, heads=4, layers=4, block=args.block)  # ~1.8M parameters
    n_params = count_params(gpt)
    engine, _, _, _ = zero_ext.initialize(model=gpt, config=config)
    if rank == 0:
        print(f"zero_ext demo: ZeRO stage {stage}, {'bf16' if args.bf16 else 'fp32'}, {world} ranks (gloo), "
              f"{n_params / 1e6:.2f}M parameters, vocab {corpus.vocab_size}, "
              f"{world} x {args.batch} x {args.block} = {world * args.batch * args.block} tokens per step", flush=True)
    if args.checkpoint:
        path, _ = engine.load_checkpoint(args.checkpoint)  # (None, None) when there is none yet
        if rank == 0 and path:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    val_before = eval_loss(engine, corpus, args)
    t0 = time.perf_counter()
    first, last = train(engine, corpus, args, rank, world)
    seconds = time.perf_counter() - t0
    val_after = eval_loss(engine, corpus, args)

    if args.checkpoint:
        engine.save_checkpoint(args.checkpoint)  # every rank writes its shard
    # forward-only passes (the evaluation) keep what the next forward reuses gathered, within
    # stage3_max_live_parameters (docs/zero3-guide.md, "Generation"): give it back before measuring
    engine.empty_partition_cache()
    rows = [None] * world if rank == 0 else None
    dist.gather_object(engine.memory_breakdown(), rows, dst=0)
    text = sample(gpt, corpus, args)
    if rank == 0:
        print(f"\ntrained {args.steps} steps in {seconds:.1f} s: train loss {first:.3f} -> {last:.3f}, "
              f"held-out loss {val_before:.3f} -> {val_after:.3f}")
        print(memory_table(rows, n_params, args.bf16, stage))
        print(f"\nsample (temperature 0.8):\n{text}")
        if args.checkpoint:
            print(f"\ncheckpoint saved in {args.checkpoint} at step {engine.global_steps}; run the same command "
                  "again to resume from it")
    dist.barrier()  # every rank done with its collectives before any tears the process group down
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
