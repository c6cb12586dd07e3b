"""ZeRO-3 generation speed: HF ``generate`` on 2 CPU ranks (gloo), a tiny Llama and a tiny GPT-2.

    python benchmarks/bench_generate.py [--tokens 32] [--repeats 3] [--world 2]

Milliseconds per generated token on rank 0 -- wall-clock, and the CPU time of rank 0's process (all its
threads; less sensitive to other load on a shared machine, blind to time spent waiting) -- greedy, ``synced_gpus=True`` in every mode, each rank with
its own prompt, all modes in the same run, taken in turns (``--repeats`` rounds of one generation per
mode, the best round of each: on a shared machine every mode sees the same load):

- unpartitioned: the plain model on every rank (the baseline of the ratios);
- partitioned: the ZeRO-3 engine's model, every parameter partitioned (persistence threshold 0): the
  first forward records the trace, the second gathers along it and, the model fitting
  stage3_max_live_parameters, makes it resident (zero/resident.py): later forwards gather nothing and
  the ranks compare their fetches after resident forwards 1, 2, 4, ..., 64 and every 64th;
  "no check": the same with the fetch-order agreement off (ZERO_EXT_CHECK_FETCH_ORDER=0), its share;
  "streaming": stage3_max_live_parameters at ``--live-fraction`` of the model (default a quarter), so
  it cannot be resident: each forward gathers what was not kept, prefetched along the trace (see
  [Note: streaming decoding] in zero/streaming.py: its fetch order is checked by stamps in the gathers);
  "streaming, rows": the same with the check as it was before (one agreement row per prefetch batch, per
  on-demand gather and per forward);
- gathered: inside ``GatheredParameters(model.parameters())`` (what TRL's unwrap_model_for_generation does);
- generation mode: inside ``zero_ext.zero.generation(engine)`` (the same, after its memory check).

Also printed: whether every mode generated the same tokens as the unpartitioned model, and the fetch-order
agreements and parameter gathers per token of the partitioned mode once its trace is recorded. Numbers,
not pass/fail.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _spawn import spawn_ranks  # noqa: E402

MODES = ("unpartitioned", "partitioned", "partitioned, no check", "partitioned, streaming",
         "streaming, rows", "gathered", "generation mode")


def build(kind: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
                         eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    return model.eval()


def worker(rank, world, kind, tokens, repeats, fraction, reuse, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    import zero_ext
    from zero_ext.zero import GatheredParameters, fetch, generation

    zero_ext.init_distributed(dist_backend="gloo", verbose=False)
    g = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(0, 2048, (1, 6 + 3 * rank), generator=g)  # a prompt and a length of each rank's own
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, synced_gpus=True, pad_token_id=0)

    def once(model, around):
        torch.distributed.barrier()
        e0 = time.perf_counter()
        with around():
            t0, c0 = time.perf_counter(), time.process_time()
            out = model.generate(prompt, **kw)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            e1 = time.perf_counter()
        entry = (time.perf_counter() - e0) - (e1 - t0)  # entering and leaving the block: the gather, once
        return (wall / tokens * 1e3, cpu / tokens * 1e3, entry * 1e3), out[0, prompt.shape[1]:].tolist()

    import contextlib

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
                                                                      "stage3_param_persistence_threshold": 0}}
    plain = build(kind)
    engine = zero_ext.initialize(model=build(kind), config=cfg)[0]
    live = int(sum(p.numel() for p in plain.parameters()) * fraction)
    small = {**cfg, "zero_optimization": {**cfg["zero_optimization"], "stage3_max_live_parameters": live}}
    if reuse is not None:
        small["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    streaming = zero_ext.initialize(model=build(kind), config=small)[0]
    rows = zero_ext.initialize(model=build(kind), config=small)[0]
    rows.zero_model.coordinator.stream_stamps = False  # the check as before streaming.py: a row per batch
    os.environ["ZERO_EXT_CHECK_FETCH_ORDER"] = "0"
    unchecked = zero_ext.initialize(model=build(kind), config=cfg)[0]
    model = engine.module
    runs = {"unpartitioned": (plain, contextlib.nullcontext),
            "partitioned": (model, contextlib.nullcontext),
            "partitioned, no check": (unchecked.module, contextlib.nullcontext),
            "partitioned, streaming": (streaming.module, contextlib.nullcontext),
            "streaming, rows": (rows.module, contextlib.nullcontext),
            "gathered": (model, lambda: GatheredParameters(list(model.parameters()))),
            "generation mode": (model, lambda: generation(engine))}
    for mode, (m, around) in runs.items():  # warm-up; the partitioned ones record their trace
        once(m, around)
    counts = {}
    for label, e in (("partitioned", engine), ("partitioned, streaming", streaming), ("streaming, rows", rows)):
        before = (fetch.agreements(), e.zero_model.meter.gathers)
        once(e.module, contextlib.nullcontext)
        counts[label] = ((fetch.agreements() - before[0]) / tokens, (e.zero_model.meter.gathers - before[1]) / tokens)
    # round-robin, best of the rounds per mode: every mode sees the same load on a shared machine
    results = {mode: ((float("inf"),) * 3, None) for mode in runs}
    for _ in range(repeats):
        for mode, (m, around) in runs.items():
            times, toks = once(m, around)
            results[mode] = (tuple(min(a, b) for a, b in zip(times, results[mode][0])), toks)
    stats = engine.zero_model.coordinator.stats.as_dict()
    streamed = streaming.zero_model.coordinator.stats.as_dict()
    engine.destroy()
    unchecked.destroy()
    streaming.destroy()
    rows.destroy()
    if rank == 0:
        queue.put((results, counts, stats, streamed))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", default="llama,gpt2")
    p.add_argument("--live-fraction", type=float, default=0.25,
                   help="stage3_max_live_parameters of the streaming mode, as a fraction of the model")
    p.add_argument("--reuse", type=int, default=None,
                   help="stage3_max_reuse_distance of the streaming modes (default: the config default, 1e9)")
    a = p.parse_args()
    for kind in a.models.split(","):
        results, counts, stats, streamed = spawn_ranks(worker, (a.world, kind, a.tokens, a.repeats, a.live_fraction, a.reuse), a.world, 900, kind)[0]
        base_wall, base_cpu, _ = results["unpartitioned"][0]
        n = sum(p.numel() for p in build(kind).parameters())
        print(f"\n{kind}: {n / 1e6:.1f}M parameters, {a.tokens} new tokens, greedy, synced_gpus=True, "
              f"{a.world} CPU ranks (gloo), best of {a.repeats} rounds")
        print(f"{'mode':22} {'ms/token':>9} {'x unpart.':>10} {'CPU ms/token':>13} {'x unpart.':>10} "
              f"{'block ms':>9} {'same tokens':>12}")
        for mode in MODES:
            (wall, cpu, entry), toks = results[mode]
            same = "yes" if toks == results["unpartitioned"][1] else "NO"
            block = f"{entry:9.1f}" if mode in ("gathered", "generation mode") else f"{'-':>9}"
            print(f"{mode:22} {wall:9.2f} {wall / base_wall:10.2f} {cpu:13.2f} {cpu / base_cpu:10.2f} {block} "
                  f"{same:>12}")
        print("ms/token: inside the block for gathered / generation mode; block ms: entering and leaving it "
              "(the whole-model gather and, for generation mode, the memory check), once per generate call")
        for label, (agreements, gathers) in counts.items():
            print(f"{label}, per token of a generate call after the warm-up: {agreements:.2f} fetch-order "
                  f"agreements, {gathers:.2f} parameter gathers")
        print(f"partitioned, coordinator counters at the end: {stats}")
        print(f"streaming (max_live_parameters {a.live_fraction:g} of the model), counters at the end: {streamed}")


if __name__ == "__main__":
    main()
