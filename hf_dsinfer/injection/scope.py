"""A model's own settings (DSInferConfig.settings) in force around its forward.

Forward pre / post hooks on the model enter and leave `hf_dsinfer.settings.use(...)` for each
call, so every kernel call inside (fused blocks, the native decode step, the output head, the
MoE layers) sees them, also when another thread calls the model (continuous batching's
manager). The offload engine's I/O threads, which only read and copy, keep the defaults.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from torch import nn

from hf_dsinfer import settings


@dataclasses.dataclass
class SettingsScope:
    changes: dict[str, Any]
    handles: list = dataclasses.field(default_factory=list)
    _local: threading.local = dataclasses.field(default_factory=threading.local)

    def enter(self, *_: Any) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        context = settings.use(**self.changes)
        context.__enter__()
        stack.append(context)

    def leave(self, *_: Any) -> None:
        stack = self._local.__dict__.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)

    def describe(self) -> str:
        return "settings for this model: " + ", ".join(f"{k}={v!r}"
                                                       for k, v in self.changes.items())

    def __getstate__(self) -> dict[str, Any]:
        """A copied model's hooks and handles are copies (deepcopy keeps them paired); the
        per-thread stack of entered scopes is not copied."""
        return {"changes": self.changes, "handles": self.handles}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.changes, self.handles, self._local = (state["changes"], state["handles"],
                                                   threading.local())


def install_settings(model: nn.Module, changes: dict[str, Any] | None) -> SettingsScope | None:
    if not changes:
        return None
    scope = SettingsScope(dict(changes))
    base = getattr(model, "base_model", model)  # the parity probe and some callers run it alone
    for module in {id(m): m for m in (model, base)}.values():
        scope.handles += [module.register_forward_pre_hook(scope.enter),
                          module.register_forward_hook(scope.leave, always_call=True)]
    return scope


def uninstall_settings(scope: SettingsScope | None) -> None:
    if scope is not None:
        for handle in scope.handles:
            handle.remove()
