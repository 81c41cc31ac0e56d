"""Tests change hf_dsinfer.settings (the native / ISA / AMX / kernels switches) through this:
the process's defaults for the span of one test (monkeypatch puts them back)."""

from __future__ import annotations

from hf_dsinfer import settings


def switch(monkeypatch, **changes) -> None:
    monkeypatch.setattr(settings, "_defaults", settings.defaults().replace(**changes))
