"""hf-dsinfer serve loads the model and builds the paged cache on threads that end
(serve.cli.off_main_thread), so that no OpenMP pool of the main thread sits beside the generation
thread's (hardware.release_openmp_threads says why)."""

from __future__ import annotations

import threading

import pytest

from hf_dsinfer.serve.cli import off_main_thread


def test_returns_the_result_from_another_thread():
    main = threading.get_ident()
    ident, total = off_main_thread(lambda a, b: (threading.get_ident(), a + b), 2, 3)
    assert ident != main and total == 5


def test_raises_the_error_on_the_calling_thread():
    def fail():
        raise ValueError("bad model folder")

    with pytest.raises(ValueError, match="bad model folder"):
        off_main_thread(fail)
