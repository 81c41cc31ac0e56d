"""Everything hf_dsinfer keeps on a model, in one place: `model._dsinfer`, a ModelState.

Each field has one writer (named below); the rest of the package reads them through `get`.
Copies of the model (deepcopy, pickle) copy the state with it. An HF model carries nothing else
of ours beyond the instance attributes that replace its methods (forward, generate, ...).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the writers sit in higher layers
    from hf_dsinfer.injection.walker import InjectionReport
    from hf_dsinfer.offload.schedule import OffloadEngine
    from hf_dsinfer.parallel.pipeline import StagePlan
    from hf_dsinfer.parallel.tensor import ModelPlan

STATE_ATTR = "_dsinfer"


@dataclasses.dataclass
class ModelState:
    report: InjectionReport | None = None  # while injected (injection.walker)
    engine: OffloadEngine | None = None  # while offloaded (offload.attach)
    tp_plan: ModelPlan | None = None  # loaded with only this rank's slices (parallel.loading)
    references: dict[str, Any] | None = None  # unsharded blocks for the sharded parity gate
    pp_stages: StagePlan | None = None  # loaded with only this rank's stage (pipeline_loading)
    saved_generation: dict[str, Any] | None = None  # generation fields compiled decode changed


_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelState))


def get(model: Any, field: str) -> Any:
    """The field's value on `model` (None when unset)."""
    _check(field)
    state = model.__dict__.get(STATE_ATTR)
    return None if state is None else getattr(state, field)


def put(model: Any, field: str, value: Any) -> None:
    _check(field)
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = model.__dict__[STATE_ATTR] = ModelState()
    setattr(state, field, value)
    if value is None and state == ModelState():  # nothing left: the model is as HF made it
        del model.__dict__[STATE_ATTR]


def pop(model: Any, field: str) -> Any:
    """The field's value, cleared."""
    value = get(model, field)
    if value is not None:
        put(model, field, None)
    return value


def _check(field: str) -> None:
    if field not in _FIELDS:
        raise AttributeError(f"ModelState has no field {field!r} (fields: {sorted(_FIELDS)})")
