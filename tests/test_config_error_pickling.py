"""A ConfigError raised in a worker process reaches its pool (multiprocessing pickles it): it must pickle,
and come back with the same problems and message (not the message rendered a second time)."""
import pickle

import pytest

from zero_ext.config import ConfigError, load_config
from zero_ext.config.errors import MISSING, ClientOptimizerError


def _error_of(source):
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return info.value


def test_missing_survives_pickling_as_the_same_marker():
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING


@pytest.mark.parametrize("error", [
    _error_of({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}),
    _error_of({"train_batch_size": 2, "zero_optimization": {"stage": 9}, "optimizer": {"type": "Nope"}}),
    ClientOptimizerError("not with optimizer offload", path="optimizer"),
])
def test_a_config_error_pickles_with_its_problems_and_message(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert back.problems == error.problems and back.paths == error.paths
    assert str(back).count(ConfigError.headline) == 1
