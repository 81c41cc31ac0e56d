"""The pipeline schedule simulator on cases computed by hand (stage time 1, links free unless
said): the timelines are written out in each case's comment."""

from __future__ import annotations

import pytest

from hf_dsinfer.parallel.schedule_sim import Workload, ideal_bubble, simulate

CASES = [
    # P=2, 2 prompt / 2 generation micro-batches, 1 decode step. Stage 0: P0 [0,1] P1 [1,2]
    # D0 [2,3] D1 [3,4]; stage 1: P0 [1,2] P1 [2,3] D0 [3,4] D1 [4,5]: 8 busy of 10.
    (Workload(2, 2, 2, 1, 1.0, 1.0), 5.0, 0.2),
    # one micro-batch, 2 steps: the token round trip idles every other stage slot.
    # Stage 0: P [0,1] D1 [2,3] D2 [4,5]; stage 1: [1,2] [3,4] [5,6]: 6 busy of 12.
    (Workload(2, 1, 1, 2, 1.0, 1.0), 6.0, 0.5),
    # 2 micro-batches, 2 steps, dynamic queue: fill and drain once, 12 busy of 14.
    (Workload(2, 2, 2, 2, 1.0, 1.0), 7.0, 1 / 7),
    # the same with a barrier per token: stage 0 waits for both tokens (at 3, then at 6):
    # D0,1 [3,4] D1,1 [4,5] D0,2 [6,7] D1,2 [7,8]; stage 1 ends at 9: 12 busy of 18.
    (Workload(2, 2, 2, 2, 1.0, 1.0, lockstep=True), 9.0, 1 / 3),
    # links of 0.5 both ways: P [0,1] -> [1.5,2.5] -> token at 3 -> D [3,4] -> [4.5,5.5].
    (Workload(2, 1, 1, 1, 1.0, 1.0, link_time=0.5, token_time=0.5), 5.5, 7 / 11),
    # hybrid: 4 prompt micro-batches of half cost joined into 2 generation ones, 1 step.
    # Stage 0: P0-P3 [0,2], D0 [2,3] (its token came back at 1.5, queued behind P3), D1 [3,4]
    # (token at 2.5); stage 1: P0-P3 [0.5,2.5], D0 [3,4], D1 [4,5]: 8 busy of 10.
    (Workload(2, 4, 2, 1, 0.5, 1.0), 5.0, 0.2),
    # 3 stages of different speeds, 1 micro-batch, no decode: 1 + 2 + 3.
    (Workload(3, 1, 1, 0, [1.0, 2.0, 3.0], 1.0), 6.0, 2 / 3),
]


@pytest.mark.parametrize(("work", "makespan", "bubble"), CASES)
def test_simulated_timeline(work, makespan, bubble):
    result = simulate(work)
    assert result.makespan == pytest.approx(makespan)
    assert result.bubble_fraction == pytest.approx(bubble)


def test_ideal_is_the_fill_and_drain_bound():
    equal = Workload(4, 4, 4, 9, 1.0, 1.0)  # N = 4 + 4 * 9 = 40 items: (P-1)/(N+P-1)
    assert ideal_bubble(equal) == pytest.approx(3 / 43)
    assert simulate(equal).bubble_fraction == pytest.approx(3 / 43)  # M >= P: reaches it
    lock = Workload(4, 4, 4, 9, 1.0, 1.0, lockstep=True)
    assert simulate(lock).bubble_fraction == pytest.approx(ideal_bubble(lock))
    assert ideal_bubble(lock) > 0.3  # fill and drain at every token


@pytest.mark.parametrize("stages", [2, 4, 8, 16, 32, 64])
def test_dynamic_beats_lockstep_at_every_depth(stages):
    work = Workload(stages, 2 * stages, stages, 15, 2.0, 1.0, link_time=0.05, token_time=0.05)
    dynamic, lock = simulate(work), simulate(Workload(**{**work.__dict__, "lockstep": True}))
    assert dynamic.makespan < lock.makespan
    assert ideal_bubble(work) <= dynamic.bubble_fraction + 1e-12


def test_bad_workload_raises():
    with pytest.raises(ValueError, match="prompt_micro_batches >= micro_batches"):
        Workload(2, 1, 2, 3, 1.0, 1.0)
    with pytest.raises(ValueError, match="3 stage times for 2 stages"):
        simulate(Workload(2, 2, 2, 1, [1.0, 1.0, 1.0], 1.0))
