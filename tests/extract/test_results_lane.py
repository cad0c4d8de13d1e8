"""The results lane: a drain's results taken in on a thread beside the next batch, in order, errors raised
in the driver; inline where the caller reads them next, and wholly inline without overlap."""

from __future__ import annotations

import threading

import pytest

from agent.extract.engine.driver import ResultsLane


def test_an_overlapped_take_runs_beside_the_caller_until_joined() -> None:
    release, started, order = threading.Event(), threading.Event(), []

    def slow() -> None:
        started.set()
        release.wait(10)
        order.append(("slow", threading.current_thread().name))

    with ResultsLane(overlap=True) as lane:
        lane.run(slow)  # returns while the take still waits
        assert started.wait(10)
        assert order == []  # the caller goes on (the next batch's generate) meanwhile
        release.set()
        lane.join()
        assert [what for what, _ in order] == ["slow"]
        assert order[0][1].startswith("eaglewatch-results")  # on the lane's own thread
        lane.run(lambda: order.append(("inline", threading.current_thread().name)), inline=True)
        assert order[-1] == ("inline", threading.current_thread().name)  # done before run returned


def test_takes_never_overlap_each_other_and_keep_their_order() -> None:
    release = threading.Event()
    order: list[int] = []

    def first() -> None:
        release.wait(10)
        order.append(1)

    with ResultsLane(overlap=True) as lane:
        lane.run(first)
        threading.Timer(0.2, release.set).start()
        lane.run(lambda: order.append(2))  # waits for the first before it is queued
        assert order == [1]
    assert order == [1, 2]  # leaving the lane finishes the take in flight


def test_a_takes_error_is_raised_in_the_driver_at_the_next_join() -> None:
    def bad() -> None:
        raise RuntimeError("capture writer failed: disk full")

    lane = ResultsLane(overlap=True)
    lane.run(bad)  # queued: nothing raised yet
    with pytest.raises(RuntimeError, match="disk full"):
        lane.join()
    lane.join()  # raised once
    lane.close()


def test_without_overlap_every_take_is_inline_and_all_its_time_is_the_drivers() -> None:
    seen: list[str] = []

    def bad() -> None:
        raise ValueError("bad sample")

    with ResultsLane(overlap=False) as lane:
        lane.run(lambda: seen.append(threading.current_thread().name))
        assert seen == [threading.current_thread().name]
        assert lane.waited_s > 0
        with pytest.raises(ValueError, match="bad sample"):
            lane.run(bad)  # raised by run itself: nothing is in flight


def test_a_failing_driver_waits_for_the_take_and_keeps_its_own_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    done = threading.Event()

    def take() -> None:
        done.wait(0.3)
        raise OSError("manifest not written")

    with pytest.raises(KeyError, match="engine died"), ResultsLane(overlap=True) as lane:
        lane.run(take)
        raise KeyError("engine died")
    assert "taking results in failed too: OSError: manifest not written" in capsys.readouterr().out
