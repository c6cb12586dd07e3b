"""zero_ext.optim: the optimizer side of ZeRO: partitions of the master state, gradient reduction, the step.

Files:
- zero_optimizer.py: ZeroOptimizer, the one optimizer of every stage: owns the groups, reduces, clips,
  steps and re-gathers.
- flat_group.py: FlatGroup, one param group flattened (stages 0-2).
- shard_groups.py: stage 3's sub-groups of pieces and its gradient reduce-scatter into them;
  quantized_reduce.py: that reduce-scatter as ZeRO++ qgZ's int4 all-to-all (two levels across nodes).
- grad_reduce.py: gradient reduction of stages 0-2 (at the boundary, or in buckets during backward).
- experts.py: mixture-of-experts parameters at stages 0-2: their domains (expert-data-parallel groups),
  optimizer groups, reducers and share of the gradient norm.
- nvme_step.py: the step with NVMe optimizer offload, all or nothing on every rank (NVMeStepError).
- step_phase.py: StepPhase and TRANSITIONS, the engine's step lifecycle as a table (engine.phase).
- step_check.py: the ranks' agreement before each gradient bucket and each boundary step (a rank doing
  something else raises, named, on every rank).
- loss_scaler.py: fp16 loss scaling, dynamic and static.
- schedulers.py: learning-rate schedulers with DeepSpeed's names and formulas.
- muon.py: the Muon optimizer (MuonWithAuxAdam): its param groups, and the orthogonalized update before the step;
  muon_nvme.py: its step with NVMe optimizer offload, streamed piece by piece through the swap files.
- direct_backward.py: loss.backward() called directly on an engine's output, and engine.scale(loss).
- coalesce.py: engine.coalesce_grad_reduction()'s checks and the reducers' deferral around its block.
- wall_clock.py: wall_clock_breakdown's per-phase timers (DeepSpeed's names) and their report.
- throughput.py: ThroughputTimer, the engine's tput_timer (DeepSpeed's samples-per-second timer).
- grad_views.py: DeepSpeed's gradient attributes (averaged_gradients, get_fp32_grad_partitions), a mixin.
- ds_attributes.py: DeepSpeed's optimizer attributes (loss-scale names, fp16_groups, fp32_groups_flat, ...),
  a mixin.
- bf16_master.py: bf16.bf16_master_weights_and_grads / bf16_optimizer_states: the master dtype and
  DeepSpeed's rules for them (offload with the CPU Adam unless the optimizer states are bf16).
- handed_out.py: which optimizer initialize hands out (the base itself at stage 0 over fp32, as DeepSpeed).
- factory.py: the base optimizer from the config (torch's, or the C one with optimizer offload), and
  the rules for a client's optimizer.
"""
