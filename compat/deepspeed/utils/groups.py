"""``deepspeed.utils.groups``: DeepSpeed's process-group helpers (its underscore names), each
zero_ext.moe.groups' function. ``groups.mpu`` reads and sets zero_ext's registered mpu."""
import sys
import types

from zero_ext.moe import groups as _g
from zero_ext.moe.groups import expert_parallel_ranks as _get_expert_parallel_ranks  # noqa: F401


def _create_expert_and_data_parallel(expert_parallel_size_, mp_size=None, pp_size=None, mp_mode="tp",
                                     use_data_before_expert_parallel_=False, folding_spec=None):
    if (mp_size or 1) > 1 or folding_spec is not None:
        raise NotImplementedError("deepspeed.utils.groups._create_expert_and_data_parallel: mp_size > 1 and "
                                  "folding_spec (AutoEP) are not in zero_ext; use an mpu with "
                                  "_create_expert_data_and_model_parallel")
    return _g.create_expert_and_data_parallel(expert_parallel_size_, use_data_before_expert_parallel_)


def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu, use_data_before_expert_parallel_=False):
    return _g.create_expert_data_and_model_parallel(expert_parallel_size_, mpu, use_data_before_expert_parallel_)


def initialize(ep_size=1, mpu=None):
    raise RuntimeError("deepspeed.utils.groups.initialize is deprecated (as in DeepSpeed): pass ep_size to "
                       "deepspeed.moe.layer.MoE(..., ep_size=...) instead")


_get_expert_parallel_group = _g.expert_parallel_group
_get_expert_data_parallel_group = _g.expert_data_parallel_group
_get_expert_parallel_group_ranks = _g.expert_parallel_group_ranks
_get_expert_data_parallel_group_ranks = _g.expert_data_parallel_group_ranks
_get_expert_parallel_group_dict = _g.expert_parallel_groups
_get_expert_data_parallel_group_dict = _g.expert_data_parallel_groups
_get_expert_parallel_world_size = _g.expert_parallel_world_size
_get_expert_parallel_rank = _g.expert_parallel_rank
_get_expert_parallel_src_rank = _g.expert_parallel_src_rank
_get_expert_data_parallel_world_size = _g.expert_data_parallel_world_size
_get_expert_data_parallel_rank = _g.expert_data_parallel_rank
_get_expert_broadcast_src_rank = _g.expert_broadcast_src_rank
_get_expert_model_parallel_world_size = _g.expert_tensor_parallel_world_size
_get_max_expert_size = _g.max_expert_size
_get_data_parallel_group = _g.data_parallel_group
_get_data_parallel_world_size = _g.data_parallel_world_size
_get_data_parallel_rank = _g.data_parallel_rank
_get_model_parallel_world_size = _g.model_parallel_world_size
_get_sequence_parallel_group = _g.sequence_parallel_group
_get_sequence_parallel_world_size = _g.sequence_parallel_world_size
_get_sequence_parallel_rank = _g.sequence_parallel_rank
_get_sequence_data_parallel_group = _g.sequence_data_parallel_group
_get_sequence_data_parallel_world_size = _g.sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = _g.sequence_data_parallel_rank


def _get_max_expert_size_name():
    return _g.group_name(_g.max_expert_size())


def _get_max_expert_parallel_group():
    return _g.expert_parallel_group(_get_max_expert_size_name())


def _get_broadcast_src_rank():
    group = _g.sequence_data_parallel_group()
    return _g.comm.get_global_rank(group, 0) if _g.comm.is_initialized() else 0


class _GroupsModule(types.ModuleType):
    """``groups.mpu`` and ``groups.expert_tensor_parallel_world_size`` read (and mpu sets) zero_ext's."""

    @property
    def mpu(self):
        return _g.get_mpu()

    @mpu.setter
    def mpu(self, value):
        _g.set_mpu(value)

    @property
    def expert_tensor_parallel_world_size(self):
        return _g.expert_tensor_parallel_world_size()


sys.modules[__name__].__class__ = _GroupsModule
