"""The native kernels' tests skip where the library does not build (no compiler, no SIMDe), so
a source that stopped compiling would skip them all and pass. Where gcc and the SIMDe headers
are here, the library of this CPU's best tier must build."""

from __future__ import annotations

import importlib.util

import pytest

from hf_dsinfer.kernels import _native


@pytest.mark.skipif(_native.compiler() is None or importlib.util.find_spec("simde_py") is None,
                    reason="no C compiler or no SIMDe headers here: the native kernels are off")
def test_the_library_builds_where_it_can():
    assert _native.builds(), _native.why_unavailable()
