"""Every Triton kernel compiles, with the real compiler, for sm_80 and sm_90.

The other kernel tests run Triton under its CPU interpreter, which accepts code the compiler
rejects. Here each kernel goes through Triton's whole pipeline (TTIR, TTGIR, LLVM, PTX, ptxas
to a cubin) for GPUTarget("cuda", 80, 32) and ("cuda", 90, 32), at the argument types and
constexprs its launcher really passes (tests/kernels/triton_aot_cases.py). It needs no GPU and
no CUDA driver: only Triton and the ptxas it ships. Each compile prints its registers and
spills per thread (`pytest -s`); the session ends with a per-kernel summary.

The compiles (~100 CPU-seconds from a cold Triton cache, ~20 s warm) run up front in worker
processes, one per core (at most MAX_WORKERS): fresh processes are needed anyway, since this one
imported Triton with the interpreter on (conftest). A failure stays with its own test case.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.kernels.conftest import requires_triton
from tests.kernels.triton_aot_cases import (
    ARCHS,
    JIT_HELPERS,
    AotCase,
    AotResult,
    all_cases,
    compile_case,
    compiler_process_init,
    jitted_names,
    load_kernels,
    ptxas_for,
)

pytestmark = requires_triton()

CASES = all_cases()
# Cases the real compiler rejects: case id -> the compiler's error. Each is an
# xfail(strict=True) until the kernel's owner fixes it, so a fix shows up as XPASS. None today.
COMPILER_REJECTS: dict[str, str] = {}
# Shared memory one program may use: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB. A kernel
# compiled past it fails only at launch (OutOfResources), which no interpreter run shows.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
# Oldest ptxas (CUDA release) that assembles each target.
MIN_CUDA = {80: (11, 0), 90: (12, 0)}
MAX_WORKERS = 8


def _compile_params() -> Iterator:
    for arch in ARCHS:
        for case in CASES:
            reason = COMPILER_REJECTS.get(case.id)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(case, arch, id=f"{case.id}-sm{arch}", marks=marks)


def _selected_jobs(session: pytest.Session) -> list[tuple[AotCase, int]]:
    """(case, arch) of the test_compiles items this run will execute."""
    return [(item.callspec.params["case"], item.callspec.params["arch"])
            for item in session.items if getattr(item, "originalname", "") == "test_compiles"
            and item.module.__name__ == __name__]


def _compile_all(jobs: list[tuple[AotCase, int]]) -> list[AotResult]:
    if not jobs:
        return []
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0)), MAX_WORKERS))
    # spawn: a fresh interpreter per worker that imports Triton with the interpreter off
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=compiler_process_init) as pool:
        return list(pool.map(compile_case, *zip(*jobs)))


def _summary(results: dict[tuple[str, int], AotResult]) -> list[str]:
    """Per kernel and arch: cases, register range, the most spilling case, most shared memory."""
    by_kernel: dict[tuple[str, int], list[tuple[AotCase, AotResult]]] = {}
    for case in CASES:
        for arch in ARCHS:
            if (case.id, arch) in results:
                by_kernel.setdefault((case.kernel, arch), []).append((case, results[case.id, arch]))
    header = f"{'kernel':36} {'arch':5} {'cases':>5} {'regs':>7} {'spills':>6} {'shared':>7}"
    lines = [f"{header}  most spills in"]
    for (kernel, arch), done in sorted(by_kernel.items()):
        ok = [(c, r) for c, r in done if r.error is None]
        failed = f"  ({len(done) - len(ok)} failed)" if len(ok) < len(done) else ""
        if not ok:
            lines.append(f"{kernel:36} sm_{arch} {len(done):5}{failed}")
            continue
        regs = sorted(r.regs for _, r in ok)
        worst, most = max(ok, key=lambda cr: cr[1].spills)
        where = f"{worst.label}-{worst.dtype}" if most.spills else ""
        lines.append(f"{kernel:36} sm_{arch} {len(done):5} {regs[0]:>3}-{regs[-1]:<3} "
                     f"{most.spills:>6} {max(r.shared for _, r in ok):>7}  {where}{failed}".rstrip())
    return lines


@pytest.fixture(scope="session")
def aot_results(request) -> Iterator[dict[tuple[str, int], AotResult]]:
    """(case id, arch) -> AotResult for every compile this run selected, compiled once."""
    jobs = _selected_jobs(request.session)
    results = {(case.id, arch): r for (case, arch), r in zip(jobs, _compile_all(jobs))}
    yield results
    # The summary goes to the terminal past pytest's output capture, so CI logs always show it.
    plugins = request.config.pluginmanager
    reporter, capture = plugins.getplugin("terminalreporter"), plugins.getplugin("capturemanager")
    if reporter is None or capture is None or not results:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_sep("-", "Triton AOT compiles: registers / spills per thread (cuobjdump)")
        for line in _summary(results):
            reporter.write_line(line)


def test_every_kernel_has_aot_cases():
    kernels = set(load_kernels())
    covered = {case.kernel for case in CASES}
    assert kernels == covered, (
        f"kernels without an AOT case: {sorted(kernels - covered)}; cases of no kernel: "
        f"{sorted(covered - kernels)}. Fix: add the launches of each new kernel's launcher to "
        "tests/kernels/triton_aot_cases.py.")
    # A kernel jitted outside a `_kernels()` factory, or a new @jit helper, would escape above.
    jitted = jitted_names()
    assert jitted == kernels | JIT_HELPERS, (
        f"functions passed to triton.jit: {sorted(jitted)}; kernels from `_kernels()`: "
        f"{sorted(kernels)}; known helpers: {sorted(JIT_HELPERS)}. Fix: return the kernel from "
        "its module's `_kernels()`, or list a device helper in JIT_HELPERS.")


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_toolchain(arch):
    """Compiling needs ptxas, reading registers cuobjdump (triton ships both): a missing or too
    old one fails here, named, rather than as hundreds of failed compiles."""
    import triton

    tool = ptxas_for(arch)
    version = tuple(int(v) for v in tool.version.split("."))
    assert version >= MIN_CUDA[arch], (
        f"sm_{arch}: {tool.path} is CUDA {tool.version}, too old (needs {MIN_CUDA[arch]}). Fix: "
        "reinstall triton, or point TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH at a newer "
        "ptxas.")
    assert triton.knobs.nvidia.cuobjdump.path  # raises "Cannot find cuobjdump" when absent


@pytest.mark.parametrize(("case", "arch"), _compile_params())
def test_compiles(case: AotCase, arch: int, aot_results):
    ptxas_for(arch)  # a missing toolchain fails with its own message, not a compiler trace
    r = aot_results[case.id, arch]
    print(f"\nAOT {case.kernel:36} {case.label:34} {case.dtype:4} sm_{arch} regs {r.regs:3} "
          f"spills {r.spills:5} shared {r.shared:6} {r.seconds:5.2f}s")
    if r.error is not None:
        pytest.fail(f"{case.id} does not compile for sm_{arch}:\n{r.error}", pytrace=False)
    assert r.regs > 0, f"{case.id}: no register count read from the sm_{arch} cubin"
    assert r.shared <= MAX_SHARED[arch], (
        f"{case.id}: {r.shared} bytes of shared memory per program, sm_{arch} allows "
        f"{MAX_SHARED[arch]}: it compiles but would fail to launch (OutOfResources). Fix: "
        "smaller blocks or fewer num_stages in its launcher.")
