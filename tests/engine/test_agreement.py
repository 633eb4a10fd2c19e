"""Refusals every rank agrees on (collage_train/engine/agreement.py): no rank stops alone while
the others wait in a collective (issue 48)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from cli_runner import REPO, run_ranks, tiny_overrides
from suite_device import on_cuda

from collage_train.engine.agreement import OtherRankFailed, agreement, gathered, the_same
from collage_train.errors import RUN_FAILED, ConfigError, OutOfMemory


class ThreadRanks:
    """``ranks`` threads standing in for the ranks of a launch, with an all-gather of
    Python objects between them (what ``engine.launch.gather_objects`` is across processes)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=10)
        self.slots: list[object] = [None] * ranks

    def gather_for(self, rank: int):
        def gather(value: object) -> list[object]:
            self.slots[rank] = value
            self.barrier.wait()
            found = list(self.slots)
            self.barrier.wait()
            return found

        return gather

    def run(self, section) -> list[BaseException | object]:
        """``section(rank, gather)`` on every rank; what each returned or raised."""
        outcomes: list[BaseException | object] = [None] * self.ranks

        def one(rank: int) -> None:
            try:
                outcomes[rank] = section(rank, self.gather_for(rank))
            except BaseException as err:  # the outcome under test
                outcomes[rank] = err

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes


def refusing(which: dict[int, BaseException]):
    def section(rank: int, gather) -> str:
        with agreement(gather=gather):
            if rank in which:
                raise which[rank]
        return "went on"

    return section


def test_a_refusal_on_one_rank_is_raised_on_every_rank_with_its_rank():
    outcomes = ThreadRanks(3).run(refusing({1: OutOfMemory("out of memory: 9 GiB on host")}))
    assert all(type(err) is OutOfMemory for err in outcomes), outcomes
    assert {str(err) for err in outcomes} == {"[rank 1] out of memory: 9 GiB on host"}
    assert all(err.agreed for err in outcomes)


def test_the_same_refusal_everywhere_keeps_its_line_and_the_lowest_rank_wins():
    same = ThreadRanks(2).run(refusing({0: ConfigError("bad"), 1: ConfigError("bad")}))
    assert [str(err) for err in same] == ["bad", "bad"] and all(e.agreed for e in same)
    both = ThreadRanks(2).run(refusing({0: ConfigError("first"), 1: OutOfMemory("second")}))
    assert [(type(e), str(e)) for e in both] == [(ConfigError, "[rank 0] first")] * 2


def test_a_failure_is_raised_where_it_happened_and_stops_the_others_quietly():
    crash = RuntimeError("disk gone\nmore lines")
    outcomes = ThreadRanks(2).run(refusing({1: crash}))
    assert outcomes[1] is crash  # its rank reports it as it is (a traceback, or cli's line)
    assert isinstance(outcomes[0], OtherRankFailed) and outcomes[0].quiet
    assert str(outcomes[0]) == "[rank 1] failed: RuntimeError: disk gone"
    assert outcomes[0].exit_status == RUN_FAILED


def test_no_refusal_goes_on_and_gathered_returns_every_ranks_value():
    assert ThreadRanks(2).run(refusing({})) == ["went on", "went on"]
    values = ThreadRanks(3).run(lambda rank, gather: gathered(lambda: rank * 10, gather=gather))
    assert values == [[0, 10, 20]] * 3
    with pytest.raises(ConfigError, match=r"rank 0: a, rank 2: b\); share it"):
        the_same(["a", "a", "b"], "the thing", "share it")
    assert the_same([None, None], "the thing", "share it") is None


@pytest.mark.zero
@pytest.mark.parametrize(
    ("check", "status", "line"),
    [
        ("memory", None, r"error: \[rank 1\] out of memory( ahead)?: gpt_tiny .* but 0\.0 GiB "
         r"is (free|available)"),
        ("data", 2, r"error: \[rank 1\] the corpus in data\.paths is unreadable on this node"),
        ("downstream", 2, r"error: \[rank 0\] lm-eval rejected task some_task"),
    ],
)  # fmt: skip
def test_a_check_refusing_on_one_rank_stops_every_rank_at_once_in_one_line(
    corpus_dir, cache_dir, tmp_path, monkeypatch, check, status, line
):
    """Two ranks, one of which refuses alone (its free memory, its corpus, rank 0's
    evaluation mid-run): both stop at once with the same exit status, the launch prints
    the one line naming that rank, no traceback, and no rank waits for the collective
    timeout."""
    monkeypatch.setenv("REFUSING_CHECK", check)
    args = [
        *tiny_overrides(corpus_dir, cache_dir, tmp_path / "run"),
        "distributed=zero2",
        "distributed.timeout_minutes=2",
        "train.max_steps=2",
        "eval.tasks=[some_task]" if check == "downstream" else "eval.tasks=[]",
        "eval.every=2",
    ]
    start = time.monotonic()
    result = run_ranks(*args, entry=str(REPO / "tests/support/refusing_rank.py"), timeout=300)
    assert time.monotonic() - start < 90  # not the collective's 2-minute timeout
    if status is None:  # the host check on a CPU run (a setting to change), else the state's
        status = 1 if on_cuda() else 2
    assert result.rank_exit_codes == (status, status), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (error,) = result.error_lines  # reported once, by rank 0
    assert re.match(line, error), error
