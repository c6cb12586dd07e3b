"""The engine's step lifecycle as data: :class:`StepPhase` and the table ``TRANSITIONS`` that
``ZeroEngine._advance`` follows (see engine.py, [Note: the step lifecycle])."""
from enum import Enum
from typing import Dict


class StepPhase(Enum):
    """Where a ZeroEngine is in its step cycle (``engine.phase``); see [Note: the step lifecycle].
    Gradients exist in BACKWARD, ACCUMULATED and REDUCED; the boundary step applies them."""

    IDLE = "idle"  # no gradients: after initialize, after the step that applied them, after zero_grad()
    BACKWARD = "backward"  # engine.backward() ran in this micro step
    ACCUMULATED = "accumulated"  # a micro step ended before the boundary: the gradients summed so far
    REDUCED = "reduced"  # stages 0/1: this step's gradients were averaged early (a safe_get/safe_set)
    FORWARD_ONLY = "forward_only"  # built without an optimizer: no backward, no step
    DESTROYED = "destroyed"  # engine.destroy() ran


_P = StepPhase
_TRAINING = (_P.IDLE, _P.BACKWARD, _P.ACCUMULATED, _P.REDUCED)
# event -> {phase before: phase after}. From any phase not listed the event is a lifecycle error.
TRANSITIONS: Dict[str, Dict[StepPhase, StepPhase]] = {
    "backward": {_P.IDLE: _P.BACKWARD, _P.BACKWARD: _P.BACKWARD, _P.ACCUMULATED: _P.BACKWARD},
    # step() before the boundary keeps the gradients; a step with none to apply changes nothing
    "micro_step": {_P.BACKWARD: _P.ACCUMULATED, _P.REDUCED: _P.REDUCED, _P.IDLE: _P.IDLE,
                   _P.ACCUMULATED: _P.ACCUMULATED},
    "boundary_step": {_P.BACKWARD: _P.IDLE, _P.REDUCED: _P.IDLE},
    "read_gradients": {_P.BACKWARD: _P.BACKWARD, _P.ACCUMULATED: _P.ACCUMULATED, _P.REDUCED: _P.REDUCED},
    "reduce_early": {_P.BACKWARD: _P.REDUCED, _P.ACCUMULATED: _P.REDUCED, _P.REDUCED: _P.REDUCED},
    "zero_grad": {**{p: _P.IDLE for p in _TRAINING}, _P.FORWARD_ONLY: _P.FORWARD_ONLY},
    "destroy": {p: _P.DESTROYED for p in StepPhase},
}
