"""hicache.streams.lifetime in process: what the exit hook runs, in which order, and what it says
(tests/package/test_exit.py ends real processes with it)."""

from __future__ import annotations

import pytest

from hicache.streams import lifetime


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(lifetime, "_stops", {})  # this test's stops only; the process's own stay registered


def test_stops_run_newest_first_forgotten_ones_not(clean, capsys):
    ran = []
    first = lifetime.stop_at_exit(lambda timeout: ran.append(("first", timeout)))
    gone = lifetime.stop_at_exit(lambda timeout: ran.append(("gone", timeout)))
    lifetime.stop_at_exit(lambda timeout: ran.append(("last", timeout)))
    lifetime.forget(gone)
    lifetime.forget(gone)  # idempotent
    lifetime.forget(None)
    lifetime._stop_all()
    assert ran == [("last", lifetime.EXIT_TIMEOUT_S), ("first", lifetime.EXIT_TIMEOUT_S)]
    assert capsys.readouterr().err == ""  # nothing lost: nothing said
    lifetime._stop_all()  # each stop runs once
    assert len(ran) == 2
    assert first not in lifetime._stops


def test_losses_are_said_in_one_line_and_a_failing_stop_does_not_stop_the_others(clean, capsys):
    ran = []

    def broken(timeout):
        raise OSError("disk gone")

    lifetime.stop_at_exit(lambda timeout: ran.append("a") or "3 page(s) queued for storage were not written")
    lifetime.stop_at_exit(broken)
    lifetime.stop_at_exit(lambda timeout: ran.append("c"))
    lifetime._stop_all()
    assert ran == ["c", "a"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache: at exit, a worker did not stop (OSError: disk gone); ")
    assert "3 page(s) queued for storage were not written" in err and "close() the cache" in err
