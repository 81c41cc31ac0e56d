"""DSInferConfig: the one frozen, validated configuration object of hf_dsinfer.

Every field is used; an unknown key, a wrong type or an impossible value fails at construction
with what was expected, what was given and how to fix it. The config round-trips through JSON
(`to_dict` / `from_dict`, `to_json` / `from_json`) because it is saved into a model's
config.json as its `quantization_config` and re-applied on reload.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

import torch

from hf_dsinfer.errors import DSInferConfigError
from hf_dsinfer.kernels._dispatch import BACKENDS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> torch.dtype | None:
    """Accept a torch.dtype, its name ("bfloat16", "bf16", "torch.bfloat16") or None."""
    if value is None or isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name in _DTYPES:
            return _DTYPES[name]
    raise DSInferConfigError(
        f"DSInferConfig.dtype: expected one of {sorted(_DTYPES)} (or a torch dtype, or None to "
        f"keep the model's dtype), got {value!r}. Fix: e.g. dtype=torch.bfloat16 or dtype='bfloat16'."
    )


@dataclasses.dataclass(frozen=True)
class DSInferConfig:
    """How hf_dsinfer transforms a model.

    Attributes:
        dtype: compute/weight dtype to convert the model to; None keeps the model's dtype.
        kernels: kernel backend for the fused blocks: "auto" (Triton on CUDA, CPU fast paths on
            CPU), "ref" (plain torch), "triton", or "cpu".
        strict: what to do when something cannot be fused exactly.
            None (default): an unsupported architecture raises UnsupportedModelError; a block
                that fails the parity gate keeps its HF forward and a warning is issued.
            True: both raise (UnsupportedModelError / ParityError).
            False: an unsupported model runs unmodified; a failed block falls back with a warning.
            `hf_dsinfer.explain(model)` reports every decision.
        parity_check: run each fused block class once on a probe (prefill + one cached decode
            step) against its HF original at injection time.
    """

    dtype: torch.dtype | None = None
    kernels: str = "auto"
    strict: bool | None = None
    parity_check: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.kernels not in BACKENDS:
            raise DSInferConfigError(
                f"DSInferConfig.kernels: expected one of {BACKENDS}, got {self.kernels!r}. "
                "Fix: kernels='auto' picks the fastest correct backend for the device."
            )
        _check_type("strict", self.strict, (bool, type(None)), "True, False or None")
        _check_type("parity_check", self.parity_check, (bool,), "True or False")

    # -- construction from user input -----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSInferConfig:
        if not isinstance(data, dict):
            raise DSInferConfigError(
                f"DSInferConfig.from_dict: expected a dict, got {type(data).__name__}."
            )
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise DSInferConfigError(
                    f"DSInferConfig: unknown key {key!r}.{hint} Valid keys: {names}."
                )
        return cls(**data)

    @classmethod
    def coerce(cls, value: Any) -> DSInferConfig:
        """Turn what a user may pass as `dsinfer=` into a DSInferConfig."""
        if isinstance(value, cls):
            return value
        if value is True or value is None:
            return cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise DSInferConfigError(
            f"dsinfer=: expected True, a dict or a DSInferConfig, got {type(value).__name__} "
            f"({value!r}). Fix: dsinfer=True, dsinfer={{'dtype': 'bfloat16'}} or "
            "dsinfer=hf_dsinfer.DSInferConfig(...)."
        )

    def replace(self, **overrides: Any) -> DSInferConfig:
        return self.from_dict({**self.to_dict(), **overrides})

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["dtype"] = None if self.dtype is None else _dtype_name(self.dtype)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DSInferConfig:
        return cls.from_dict(json.loads(text))


def _check_type(name: str, value: Any, types: tuple[type, ...], expected: str) -> None:
    if not isinstance(value, types):
        raise DSInferConfigError(
            f"DSInferConfig.{name}: expected {expected}, got {value!r} "
            f"({type(value).__name__}). Fix: pass {name}={expected.split(',')[0]}."
        )
