"""zero_ext.checkpoint: checkpoints in DeepSpeed's folder layout, and the offline converter.

Files:
- engine_api.py: the engine's methods (save_checkpoint, load_checkpoint, wait_for_checkpoint), mixed
  into ZeroEngine.
- engine_state.py: ``save_checkpoint`` / ``load_checkpoint`` of an engine (any stage and world size
  to any).
- files.py: checksummed writes, verified reads, the manifest, the tag's folder put in place atomically.
- shards.py: the saved optimizer files read into an engine (this rank's, or all rebuilt and cut again).
- publish.py: the end of a save on a background thread: fsync, publish the tag and ``latest``.
- serial_load.py: pipeline_loading_checkpoint: the ranks of a host load one after another.
- layout.py: which fp32 partition holds which parameter, and moving values between layouts.
- experts.py: a mixture-of-experts model's experts, one file per expert (DeepSpeed's names).
- zero_to_fp32.py: a full fp32 state dict from a checkpoint, offline (also copied into each
  checkpoint as a standalone script).
"""
