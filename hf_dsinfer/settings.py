"""The switches of the kernel paths, in one object: which native kernels may run, at which ISA
tier, with or without AMX tiles, which kernel backend `kernels="auto"` means, and where built
libraries and measurements are cached.

    HF_DSINFER_NATIVE=0        native=False: the torch paths only
    HF_DSINFER_NATIVE_AMX=0    amx=False: the native kernels keep to AVX-512 / AVX2
    HF_DSINFER_ISA=<tier>      isa=<tier>: cap the ISA tier (and run every kernel at it)
    HF_DSINFER_KERNELS=<name>  kernels=<name>: what kernels="auto" resolves to
    HF_DSINFER_CACHE=<dir>     cache_dir=<dir> (default ~/.cache/hf_dsinfer, or
                               $XDG_CACHE_HOME/hf_dsinfer)

The environment variables are only the defaults, read once, at the first use. Code reads
`current()`: the settings of the model being run (`DSInferConfig(settings={...})`, applied
around that model's forward by hf_dsinfer.phases) or else the defaults. `use(...)` sets them
for a block of code (`with hf_dsinfer.settings.use(native=False): ...`); `set_defaults(...)`
changes the defaults of the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hf_dsinfer.errors import DSInferConfigError

TIERS = ("generic", "avx2", "avx2_vnni", "avx512", "avx512_bf16", "amx")  # lowest first
# (kernels/_native.py; avx2_vnni is a branch off avx2: the avx512 tiers do not need AVX-VNNI)
BACKENDS = ("auto", "ref", "triton", "cpu")  # kernels/_dispatch.py
ENV = {"native": "HF_DSINFER_NATIVE", "amx": "HF_DSINFER_NATIVE_AMX", "isa": "HF_DSINFER_ISA",
       "kernels": "HF_DSINFER_KERNELS", "cache_dir": "HF_DSINFER_CACHE"}


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "hf_dsinfer"


@dataclasses.dataclass(frozen=True)
class Settings:
    native: bool = True
    amx: bool = True
    isa: str | None = None
    kernels: str = "auto"
    cache_dir: Path = dataclasses.field(default_factory=lambda: _default_cache_dir(os.environ))

    def __post_init__(self) -> None:
        for name in ("native", "amx"):
            if not isinstance(getattr(self, name), bool):
                raise DSInferConfigError(f"settings.{name}: expected True or False, got "
                                         f"{getattr(self, name)!r}")
        if self.isa is not None and self.isa not in TIERS:
            raise DSInferConfigError(
                f"settings.isa (env {ENV['isa']}): {self.isa!r} is not an ISA tier: expected "
                f"one of {', '.join(TIERS)}, or None for this CPU's best. Fix: name one of those "
                f"or unset {ENV['isa']}.")
        if self.kernels not in BACKENDS:
            raise DSInferConfigError(
                f"settings.kernels (env {ENV['kernels']}): expected one of {BACKENDS}, got "
                f"{self.kernels!r}. Fix: 'auto' picks the fastest correct backend.")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The defaults the environment asks for (unset variables keep the built-in ones)."""
        isa = environ.get(ENV["isa"], "").strip().lower() or None
        cache = environ.get(ENV["cache_dir"])
        return cls(native=environ.get(ENV["native"], "1") != "0",
                   amx=environ.get(ENV["amx"], "1") != "0", isa=isa,
                   kernels=environ.get(ENV["kernels"], "auto").strip().lower() or "auto",
                   cache_dir=Path(cache) if cache else _default_cache_dir(environ))

    def replace(self, **changes: Any) -> Settings:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise DSInferConfigError(f"settings: unknown {unknown}; expected some of "
                                     f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "cache_dir": str(self.cache_dir)}


_defaults: Settings | None = None
_current: contextvars.ContextVar[Settings | None] = contextvars.ContextVar(
    "hf_dsinfer_settings", default=None)


def defaults() -> Settings:
    """The process's defaults: from the environment, read at the first call."""
    global _defaults
    if _defaults is None:
        _defaults = Settings.from_env()
    return _defaults


def current() -> Settings:
    """The settings in force here: those of the running model or `use` block, else defaults.
    Inside a torch.compile trace (which cannot read a context variable) the defaults: traced
    code runs no native kernel, and its backends were chosen at injection."""
    if torch.compiler.is_compiling():
        return defaults()
    active = _current.get()
    return defaults() if active is None else active


def set_defaults(settings: Settings | None = None, **changes: Any) -> Settings:
    """Replace the process's defaults (None: read the environment again); returns the old ones."""
    global _defaults
    old = defaults()
    _defaults = (settings if settings is not None else
                 Settings.from_env() if not changes else old).replace(**changes)
    return old


@contextlib.contextmanager
def use(settings: Settings | None = None, **changes: Any) -> Iterator[Settings]:
    """Run a block under `settings` (or the current ones with `changes`)."""
    chosen = (settings or current()).replace(**changes)
    token = _current.set(chosen)
    try:
        yield chosen
    finally:
        _current.reset(token)


def coerce(value: Any) -> dict[str, Any] | None:
    """A per-model settings change as DSInferConfig keeps it: None or a dict of known fields
    (validated by building Settings from it)."""
    if value is None:
        return None
    if isinstance(value, Settings):
        value = {k: v for k, v in value.to_dict().items()
                 if v != Settings().to_dict()[k]}
    if not isinstance(value, dict):
        raise DSInferConfigError(
            f"DSInferConfig.settings: expected None or a dict such as {{'native': False}} or "
            f"{{'isa': 'avx2', 'amx': False}}, got {type(value).__name__} ({value!r}).")
    Settings().replace(**value)  # validates names and values
    return dict(value)
