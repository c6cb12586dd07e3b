"""DeepSpeedConfig's ``eigenvalue_*`` attributes: the eigenvalue settings of MoQ quantize-aware training.

DeepSpeed reads them from ``quantize_training.eigenvalue`` only when ``quantize_training`` is switched on,
and refuses ``eigenvalue.enabled`` there ("temporarily disabled"); otherwise every one is its default. zero_ext
loads such a config and refuses quantize_training when the engine is built, so scripts that inspect a
config read the same values as with DeepSpeed."""
from typing import Any, Dict

from ..config import ConfigError

#: (DeepSpeedConfig attribute, key in quantize_training.eigenvalue, DeepSpeed's default)
EIGENVALUE_SETTINGS = (
    ("eigenvalue_enabled", "enabled", False),
    ("eigenvalue_verbose", "verbose", False),
    ("eigenvalue_max_iter", "max_iter", 100),
    ("eigenvalue_tol", "tol", 1e-2),
    ("eigenvalue_stability", "stability", 1e-6),
    ("eigenvalue_gas_boundary_resolution", "gas_boundary_resolution", 1),
    ("eigenvalue_layer_name", "layer_name", "bert.encoder.layer"),
    ("eigenvalue_layer_num", "layer_num", 0),
)


def eigenvalue_settings(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The eight attributes for the config dict ``raw`` (as given), as DeepSpeed derives them."""
    section = raw.get("quantize_training") or {}
    given = (section.get("eigenvalue") or {}) if section.get("enabled", False) else {}
    if given.get("enabled", False):
        raise ConfigError("eigenvalue-based MoQ is disabled in DeepSpeed (and zero_ext has no MoQ); set it to false",
                          path="quantize_training.eigenvalue.enabled", value=given["enabled"])
    return {attr: given.get(key, default) for attr, key, default in EIGENVALUE_SETTINGS}
