"""The engine's config accessors (DeepSpeed's names), mixed into ZeroEngine: what libraries ask an engine
about its batch shape, precision and ZeRO stage, read from the validated config (``self._config``)."""


class ConfigQueries:
    """train_batch_size, zero_optimization_stage, bfloat16_enabled, ... of ZeroEngine."""

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_batch_info(self):
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self._config.zero_optimization.stage > 0

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def zero_quantized_weights(self) -> bool:
        return self._config.zero_optimization.zero_quantized_weights

    def managed_gradient_accumulation(self) -> bool:
        """False: the caller's every step() is the accumulation boundary (DeepSpeed's key of that name)."""
        return self._config.managed_gradient_accumulation

    def log_level(self):
        """The config's log_level as given (None when absent), as DeepSpeed's engine answers."""
        return self._config.log_level

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def zero_optimization_partition_weights(self) -> bool:
        """Whether the parameters are partitioned (stage 3)."""
        return self.zero_optimization_stage() >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.gather_16bit_weights_on_model_save: whether a 16-bit save of a ZeRO-3 model
        gathers the weights (accelerate asks before calling _zero3_consolidated_16bit_state_dict)."""
        return self._config.zero_optimization.gather_16bit_weights_on_model_save

    @property
    def config(self):
        return self._config
