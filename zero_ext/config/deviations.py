"""Every place where zero_ext's config handling knowingly differs from DeepSpeed 0.19.x, and why.

Plain data, rendered into docs/config.md by :mod:`.docgen`. Each entry:
(topic, what DeepSpeed does, what zero_ext does, why).
"""

DEVIATIONS = [
    ("Unknown keys",
     "Ignores unknown top-level keys and unknown aio keys; pydantic sections fail with a raw "
     "ValidationError.",
     "Every unknown key is an error naming its path and the closest valid key of that section "
     "(names and aliases), or the section where it belongs.",
     "A misspelt key silently keeps a default; that is the commonest config bug."),
    ("Sections of other DeepSpeed subsystems",
     "Used (monitors, profiler, pipeline, elasticity, compression, ...).",
     "Monitoring/tooling sections are accepted with one warning and ignored (kept in "
     "cfg.ignored_sections); feature sections (elasticity, amp, compile, ...) are accepted and "
     "refused by the engine when switched on.",
     "Real-world files must load unchanged; what would change training is never dropped "
     "silently."),
    ("offload_param with stage 0/1/2",
     "Silently ignored.",
     'Error when device is not "none".',
     "A no-op the user did not ask for."),
    ("NVMe optimizer offload with stage 1/2",
     "Stage 1/2 silently fall back to CPU offload.",
     "Implemented: masters and optimizer state go to NVMe at stages 1-3 alike; at stages 1/2 the "
     "partition is swapped in slices of sub_group_size elements.",
     "The user asked for NVMe and gets it; the swap store does not depend on the stage."),
    ("Optimizer offload with stage 0",
     "Ignored.",
     "Error.",
     "The user asked for offload and would not get it."),
    ("offload_optimizer.ratio < 1 without an offload device; super_offload without stage 3",
     "No effect / not checked in the config.",
     "Error.",
     "No silent no-ops."),
    ("elastic_checkpoint",
     "Stages 1-2: each rank reads every rank's optimizer file and merges them (loads across "
     "world sizes); stage 3: a deprecation warning.",
     "A deprecation warning at every stage (a ConfigDeprecationWarning, as for every deprecated key; "
     "DeepSpeed logs its stage-3 notice on its logger); the key has no effect.",
     "zero_ext checkpoints reshard natively: any world size and stage load any checkpoint."),
    ("Checks DeepSpeed makes only in initialize",
     "pipeline_loading_checkpoint needs stage 3, legacy_stage1 is refused, allgather_bucket_size "
     "must be even (stages 1-2), reduce-scatter (stages 2-3) forbids gradient_predivide_factor "
     "!= 1 and prescale_gradients, 1-bit optimizers refuse ZeRO: assertions in initialize.",
     "The same conditions are errors at load, naming the keys.",
     "Earlier and clearer; same accepted configs."),
    ("cpu_offload_use_pin_memory",
     "Deprecation warning; the value is otherwise ignored.",
     "Deprecation warning, and the value is applied as pin_memory of the offload sections "
     "(an explicit, different pin_memory is an error).",
     "The issue asks deprecated keys to map to their replacements; dropping the user's choice "
     "would be silent."),
    ("Deprecated switch set to false next to its replacement",
     "cpu_offload/cpu_offload_param given at all together with offload_optimizer/offload_param "
     "is an assertion error.",
     "false is dropped with a deprecation warning; only true together with the replacement is "
     "an error.",
     "false asks for nothing, so there is no conflict."),
    ("Stage-3-only keys at stage < 3",
     "Silently unused.",
     "One warning naming them.",
     "Usually a mistake (the stage was lowered and the keys stayed)."),
    ("zero_optimization.grad_hooks",
     "Documented in config-json.md, but not a field of the code: the key is rejected.",
     "Accepted (default true); false is refused at initialize until implemented.",
     "Accept the documented spelling instead of failing on it."),
    ("aio.thread_count",
     "Documented in config-json.md but not read by the code.",
     "Accepted as an alias of intra_op_parallelism.",
     "Accept the documented spelling instead of dropping it."),
    ('"auto" values',
     'Dropped (default used) only inside pydantic sections; a top-level "auto" (batch sizes, '
     "gradient_clipping) reaches DeepSpeed as a string unless HF Trainer/Accelerate filled it.",
     '"auto" means the default everywhere; the batch sizes are derived from the others '
     "(micro batch 1 when nothing fixes it, as HF Accelerate substitutes). Resolutions are "
     "logged once and kept in cfg.auto_resolved.",
     "HF-style files load without HF's preprocessing."),
    ("Numbers",
     "pydantic's lax mode takes true as 1 for numbers; scheduler warmup_num_steps must be a "
     "Python int.",
     "Booleans are refused for numeric keys; integral floats such as 5e8 or 1e3 are accepted "
     "for every integer key.",
     "A boolean size is always a mistake; 5e8 is how DeepSpeed users write sizes."),
    ("Batch arithmetic",
     "Derives with floor division, then asserts train == micro * gas * world_size.",
     "Same rules; a non-divisible input is reported with the division that failed, and "
     "impossible triples are reported before the world size is known.",
     "Messages show the numbers that do not fit."),
    ("Config text given as a string",
     "A string must be a file path or base64; base64 text is read with hjson without the "
     "duplicate-key check.",
     "JSON/hjson text is accepted as a string too; duplicate keys are errors in every source.",
     "One reading rule for every source."),
    ("A key given twice (name and alias, e.g. bf16 and bfloat16)",
     "One silently wins (bf16 over bfloat16; pydantic keeps one of name/alias).",
     "Error.",
     "Two values for one setting is ambiguous."),
    ("fp16.hysteresis, fp16.initial_scale_power, module_granularity_threshold",
     "Unchecked integers.",
     "hysteresis >= 1, initial_scale_power in [0, 127], module_granularity_threshold >= 0.",
     "Other values break the loss scaler or are meaningless; 2**127 is the largest power of two "
     "a float32 loss scale holds (2.0**1e6 is an OverflowError)."),
    ("Integer ranges",
     "Integers are unbounded Python ints (e.g. sub_group_size 1e30 fails inside the optimizer "
     "setup, gradient_accumulation_steps 1e30 at the first backward).",
     "Every integer key is within the signed 64-bit range; element counts (bucket sizes, "
     "sub_group_size, persistence thresholds, live/reuse limits, offload buffer_size and "
     "max_in_cpu) are at most 2**62; the derived train_batch_size must fit int64; "
     "mics_shard_size >= -1; zero_hpz_partition_size and mics_shard_size < 2**31.",
     "Larger values overflow the C planner, torch or the loss scaler; the error names the key."),
    ("ZeRO++ qwZ / qgZ formats",
     "qwZ: int8 in groups sized by an adaptive rule around 2048 elements over the whole gathered "
     "buffer (fp16 on the wire path); qgZ: int4 in groups of about one row, two-level all-to-all "
     "(intra-node, then inter-node) and a plain reduce-scatter for 1-D tensors.",
     "qwZ: int8, 2048-element blocks; qgZ: int4, 512-element blocks, one all-to-all over the data-"
     "parallel group, synchronous, 1-D parameters unquantized; both quantize each parameter's piece on "
     "its own, in its own dtype (bf16 stays bf16), with the bound stated in docs/precision.md.",
     "A parameter's value does not depend on which others shared its bucket, so runs are reproducible "
     "and testable against a reference; the two-level all-to-all (fewer bytes across nodes) is not "
     "built yet."),
    ("ZeRO++ hpZ with offload_param",
     "Not checked.",
     "Error: zero_hpz_partition_size > 1 with offload_param.",
     "hpZ's secondary copy lives on the device, where offloading the parameters was meant to free "
     "memory."),
    ("MiCS (mics_shard_size, mics_hierarchical_params_gather)",
     "0.19.8 removed MiCS (deepspeedai/DeepSpeed#8489). Before: a model had to be built under "
     "zero.MiCS_Init; a shard size not dividing the world failed an assert; hpZ was silently unused; "
     "optimizer offload failed at the first gradient reduction; mics_hierarchical_params_gather without "
     "mics_shard_size was ignored; a shard group inside one node with the hierarchical gather failed an "
     "assert.",
     "Kept, with the semantics of the last DeepSpeed that had it (zero/mics.py). initialize also "
     "partitions a model built whole; the bad combinations are ConfigErrors naming the key: a shard size "
     "not dividing the world, MiCS with hpZ, with offload_optimizer when there are replicas, the "
     "hierarchical gather without MiCS, inside one node, or with qwZ.",
     "Users of MiCS keep their configs; what would be ignored or fail late is refused up front."),
    ("aio limits",
     "Any positive block_size, queue_depth and thread count.",
     "block_size a multiple of 4096 up to 2**30 bytes, queue_depth <= 4096, "
     "intra_op_parallelism <= 64 (the limits of zero_ext's C aio engine).",
     "Outside them the first NVMe swap fails; refusing at load names the key."),
    ("NVMe buffer_count",
     "buffer_count >= 0 for both offload sections; too few buffers fail later in the swapper.",
     'With device "nvme": offload_param.buffer_count >= 1; offload_optimizer.buffer_count >= 1, '
     "+1 for pipeline_read, +1 for pipeline_write (3 with both).",
     "zero_ext's NVMe store refuses fewer at the first step; the config says so at load. (A model "
     "whose partition is a single sub-group would need fewer; it is refused too.)"),
    ("Optimizer and scheduler params",
     "Passed as keyword arguments; a wrong key is a TypeError inside initialize; an unknown "
     "warmup_type falls back to log with a warning.",
     "Adam/AdamW, Adagrad and Lion params, the params of torch.optim classes (keys from the "
     "constructor's signature) and the params of DeepSpeed's five schedulers are checked at load "
     "(unknown keys with suggestions, ranges, finiteness, required keys given as null, "
     "torch-only Adam arguments, Adagrad arguments of the implementation not chosen); unknown "
     "optimizer/scheduler types are errors at load.",
     "Errors at load, naming the key."),
    ("Optimizer eps = 0, scheduler momentum >= 1, negative decay rates",
     "torch and DeepSpeed's optimizers accept eps = 0; OneCycle's cycle_min_mom/cycle_max_mom "
     "and decay rates are not checked.",
     "eps > 0 (Adam/AdamW, Adagrad, torch.optim classes); OneCycle momenta in [0, 1); "
     "decay_lr_rate and decay_mom_rate >= 0; learning rates finite and >= 0.",
     "eps 0 divides by zero where a state is 0; beta1 = 1 makes Adam's bias correction divide "
     "by zero; a negative decay rate makes the lr negative or infinite."),
    ("gradient_allreduce_op \"sum\" with prescale_gradients or gradient_predivide_factor",
     "Accepted; the scaling is skipped when gradients are summed.",
     "Accepted and skipped too, with a warning naming the key.",
     "No silent no-ops; configs written for \"mean\" still load."),
    ("Muon's Newton-Schulz iteration",
     "Runs in bf16 (standard) or fp16 (gram) where the accelerator supports them, else fp32.",
     "Always fp32.",
     "Deterministic, and the same bits on CPU and GPU; the iteration is cheap next to the step."),
    ("Muon with fp16",
     "Accepted; the orthogonalized update is then divided by the loss scale.",
     "Error at load, unless fp16.loss_scale is a static 1 (nothing is scaled, so both agree).",
     "The update would shrink with the loss scale: silently wrong training."),
    ("legacy allgather_size without the legacy boolean zero_optimization",
     "Silently unused.",
     "Error pointing to zero_optimization.allgather_bucket_size.",
     "No silent no-ops."),
]
