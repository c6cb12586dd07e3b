"""The engine's checkpoint methods (DeepSpeed's names), mixed into ZeroEngine: they check the engine can
save or load, bring NVMe-offloaded state into memory for the call, and hand over to engine_state.py."""
import logging
import os
import stat

from .engine_state import load_checkpoint, save_checkpoint, settle_publish


class CheckpointMethods:
    """save_checkpoint / load_checkpoint / wait_for_checkpoint of ZeroEngine (see docs/checkpoints.md)."""

    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective: every rank writes its shard. Returns once the files are written and checksummed; the
        tag and `latest` appear when rank 0 has made them durable, in the background (wait_for_checkpoint)."""
        self._require_alive("save_checkpoint")  # (its optimizer state is gone: the checkpoint would be incomplete)
        with self._state_in_memory(modified=False):
            saved = save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if self.zero_model is not None:
            # Stage 3 leaves its persistent parameters whole after a save, as after a load or a step (DeepSpeed's
            # checkpoint epilogue does the same): released by empty_partition_cache, they are readable again.
            self.zero_model.refresh_persistent()
        return saved

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Collective. Returns (load_path, client_state), or (None, None) when there is nothing to load."""
        self._require_alive("load_checkpoint")
        with self._state_in_memory(modified=True):
            return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                   load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag, expp_rank: int) -> str:
        """DeepSpeed's path of expert-parallel rank ``expp_rank``'s optimizer file (MoE checkpoints), for code
        that builds or patches it. zero_ext neither writes nor reads such a file: the partitions of expert
        groups are in each rank's ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` like any other
        (the experts' weights in DeepSpeed's ``layer_<L>_expert_<E>`` files: checkpoint/experts.py)."""
        return os.path.join(checkpoints_path, str(tag), f"expp_rank_{expp_rank}_mp_rank_00_optim_states.pt")

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """DeepSpeed's helper: makes the recovery script ``dst`` executable; where that is not possible (a
        missing file, a file share without permissions) it logs at INFO on the ``zero_ext`` logger
        (``deepspeed.utils.logger``) and goes on. zero_ext's own save writes ``zero_to_fp32.py`` executable
        already (its read bits, from the umask, plus the matching execute bits) and does not call it."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as exc:
            logging.getLogger("zero_ext").info(f"could not make {dst} executable ({exc}); continuing without")

    def wait_for_checkpoint(self) -> None:
        """Collective: returns once the last save_checkpoint's tag folder and `latest` are durable and in
        place (before copying or uploading the folder); raises CheckpointPublishError if that failed."""
        settle_publish(self)
