"""Tensor-parallel faults: a copy that fails on ONE rank only, and an error inside ``load_back`` on one
rank only. Two CPU ranks (gloo, spawned processes) run the same operations; the failure is injected on
rank 1. The failed copy must be rolled back on both ranks (the ranks' trees stay the same: a later
decision cannot differ and leave one rank waiting in a collective), and a rank that raises inside
``load_back`` must still take part in the decision's collective (no hang)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from cachedriver import build, insert_seq, state_of
from tpharness import rank_report, run_ranks

from hicache import CopyError, CopyFailedOnPeer

WORLD = 2
TIMEOUT_S = 300  # a hang detector, not a speed limit
TOKENS = list(range(100, 124))


def fail_on(cache, kind: str) -> None:
    """Make every ``kind`` copy ("write" or "load") of ``cache``'s controller raise."""
    inner = cache.controller._issue

    def execute(op, stream):
        if op.kind == kind:
            raise OSError(f"injected {kind} failure")
        return inner(op, stream)

    cache.controller._issue = execute


def scenario_write(rank: int, group) -> dict:
    cache = build(tp_group=group)
    if rank == 1:
        fail_on(cache, "write")
    insert_seq(cache, TOKENS)  # write-through: the backup is submitted (inline: issued at once)
    with pytest.raises(CopyError) as err:
        cache.flush()  # landed (and failed) everywhere: processed
    causes = [type(e).__name__ for _, _, e in err.value.failures]
    cache.verify()
    state = state_of(cache)
    cache.close()
    return dict(state=state, causes=causes, failed=cache.metrics.writes_failed)


def scenario_load(rank: int, group) -> dict:
    cache = build(tp_group=group)
    insert_seq(cache, TOKENS)
    cache.flush()
    cache.evict(cache.device_pool.size)
    if rank == 1:
        fail_on(cache, "load")
    m = cache.match_prefix(TOKENS)
    assert m.host_hit_length == len(TOKENS)
    assert cache.load_back(m.last_host_node) is not None
    cache.start_loading()
    with pytest.raises(CopyError) as err:
        cache.flush()
    causes = [type(e).__name__ for _, _, e in err.value.failures]
    cache.verify()
    after = cache.match_prefix(TOKENS)  # the lost device copy is gone: the prefix is host-only again
    state = state_of(cache)
    cache.close()
    return dict(state=state, causes=causes, device_hit=len(after.device_indices), host_hit=after.host_hit_length)


def host_hit_that_must_evict(rank: int, group):
    """A cache whose device pool is full and ``TOKENS`` a host-only hit (loading it back must evict);
    on rank 1 the load-back's eviction raises until ``restore(cache)``. The cache and the match."""
    cache = build(tp_group=group, device_slots=24)
    insert_seq(cache, TOKENS)
    cache.flush()
    cache.evict(cache.device_pool.size)
    insert_seq(cache, list(range(300, 324)))  # fills the device pool again
    cache.flush()
    if rank == 1:

        def evict(n):
            raise RuntimeError("injected eviction failure")

        cache.load_backs.evict = evict  # the eviction the load-back calls
    return cache, cache.match_prefix(TOKENS)


def restore(cache) -> None:
    cache.load_backs.evict = cache.evict


def scenario_load_back_raises(rank: int, group) -> dict:
    """The device pool is full, so ``load_back`` must evict; on rank 1 eviction raises. Rank 1 raises,
    rank 0 is told the load-back is off (the collective happened on both), and both carry on."""
    cache, m = host_hit_that_must_evict(rank, group)
    outcome = "loaded"
    try:
        if cache.load_back(m.last_host_node) is None:
            outcome = "skipped"
    except RuntimeError as exc:
        outcome = f"raised: {exc}"
    if rank == 1:
        restore(cache)
    # Both ranks go on with the same collectives: a hang here would mean one skipped the decision's.
    cache.flush()
    cache.verify()
    state = state_of(cache)
    cache.close()
    return dict(state=state, outcome=outcome)


def scenario_step_load_back_raises(rank: int, group) -> dict:
    """As above with the decision left to the step (``agree="step"``): no collective inside
    ``load_back``; rank 1 records its error and raises it from ``agree_load_backs``, after the one
    collective, where rank 0 learns that its load-back did not go everywhere and revokes it."""
    cache, m = host_hit_that_must_evict(rank, group)
    went = cache.load_back(m.last_host_node, agree="step") is not None
    if rank == 1:
        restore(cache)
    try:
        outcome = f"revoked {cache.agree_load_backs() == [m.last_host_node.id]}"
    except RuntimeError as exc:
        outcome = f"raised: {exc}"
    cache.flush()  # both go on: no rank waits in a collective the other skipped
    cache.verify()
    after = cache.match_prefix(TOKENS)
    state = state_of(cache)
    cache.close()
    return dict(state=state, outcome=outcome, went=went, device_hit=len(after.device_indices))


def scenario_write_back_eviction_before_the_agreement(rank: int, group) -> dict:
    """Write-back, ``agree="step"``: rank 0's load-back is queued, rank 1's raised when it was queued (after
    the same evictions as rank 0's: under write-back an eviction agrees on its backups' acks, a
    collective, so both ranks evict alike); then both evict, which backs up device-only victims and waits
    for them. That wait must not start rank 0's queued load-back: the agreement then revokes it (it did
    not go on rank 1), and a started one could not be cancelled (ValueError on rank 0)."""
    cache = build(tp_group=group, device_slots=48, write_policy="write_back")
    insert_seq(cache, TOKENS)
    cache.flush()
    cache.evict(cache.device_pool.size)  # backed up (write-back: on eviction), then dropped: host-only
    insert_seq(cache, list(range(300, 324)))
    insert_seq(cache, list(range(400, 424)))  # device-only, the pool full
    m = cache.match_prefix(TOKENS)
    if rank == 1:

        def load(host, device, node_id):
            raise RuntimeError("injected load failure")

        cache.controller.load = load  # the load-back's queueing, after its eviction
    went = cache.load_back(m.last_host_node, agree="step") is not None
    if rank == 1:
        del cache.controller.load
    try:
        cache.evict(8)  # a write-back eviction while rank 0's load-back waits for the step's agreement
        outcome = f"revoked {cache.agree_load_backs() == [m.last_host_node.id]}"
    except (RuntimeError, ValueError) as exc:
        outcome = f"raised {type(exc).__name__}: {exc}"
    cache.flush()
    cache.verify()
    after = cache.match_prefix(TOKENS)
    cache.close()
    return dict(outcome=outcome, went=went, device_hit=len(after.device_indices))


SCENARIOS = {"write": scenario_write, "load": scenario_load, "load_back_raises": scenario_load_back_raises,
             "step_load_back_raises": scenario_step_load_back_raises,
             "write_back_eviction": scenario_write_back_eviction_before_the_agreement}  # fmt: skip


def rank_main(rank: int, init_file: str, out) -> None:
    work = lambda: {name: fn(rank, dist.group.WORLD) for name, fn in SCENARIOS.items()}  # noqa: E731
    rank_report(rank, WORLD, init_file, 60, out, work)


@pytest.fixture(scope="module")
def tp_faults(tmp_path_factory) -> dict[int, dict]:
    init_file = str(tmp_path_factory.mktemp("tpf") / "store")
    return run_ranks(rank_main, (init_file,), WORLD, TIMEOUT_S, grace_s=70)  # a collective times out at 60 s


def test_a_backup_failing_on_one_rank_is_rolled_back_on_both(tp_faults):
    a, b = tp_faults[0]["write"], tp_faults[1]["write"]
    assert b["causes"] == ["OSError"] and a["causes"] == [CopyFailedOnPeer.__name__]
    assert a["failed"] == b["failed"] == 1
    assert a["state"] == b["state"]
    assert all(host is None for _, _, host, *_ in a["state"]["nodes"])  # device-only on both


def test_a_load_failing_on_one_rank_is_rolled_back_on_both(tp_faults):
    a, b = tp_faults[0]["load"], tp_faults[1]["load"]
    assert b["causes"] == ["OSError"] and a["causes"] == [CopyFailedOnPeer.__name__]
    assert a["state"] == b["state"]
    assert a["device_hit"] == b["device_hit"] == 0 and a["host_hit"] == b["host_hit"] == len(TOKENS)


def test_an_error_inside_load_back_on_one_rank_does_not_hang_the_other(tp_faults):
    """The raising rank changed nothing; the other had evicted to make room before the (agreed) no,
    so device residency differs: a rank-local error is the caller's to treat as fatal, but it is
    reported on its rank and no rank is left waiting in a collective (both went on to flush)."""
    a, b = tp_faults[0]["load_back_raises"], tp_faults[1]["load_back_raises"]
    assert a["outcome"] == "skipped" and b["outcome"] == "raised: injected eviction failure"
    host = [(path, host) for path, _, host, *_ in a["state"]["nodes"]]
    assert host == [(path, host) for path, _, host, *_ in b["state"]["nodes"]]  # the same host tier
    assert a["state"]["host_state"] == b["state"]["host_state"]


def test_a_step_load_back_failing_on_one_rank_is_revoked_on_the_other(tp_faults):
    a, b = tp_faults[0]["step_load_back_raises"], tp_faults[1]["step_load_back_raises"]
    assert a["went"] and not b["went"]
    assert a["outcome"] == "revoked True" and b["outcome"] == "raised: injected eviction failure"
    assert a["device_hit"] == b["device_hit"] == 0  # loaded on neither
    host = [(path, host) for path, _, host, *_ in a["state"]["nodes"]]
    assert host == [(path, host) for path, _, host, *_ in b["state"]["nodes"]]
    assert a["state"]["host_state"] == b["state"]["host_state"]


def test_a_write_back_eviction_does_not_start_an_unagreed_load_back(tp_faults):
    a, b = tp_faults[0]["write_back_eviction"], tp_faults[1]["write_back_eviction"]
    assert a["went"] and not b["went"]
    assert a["outcome"] == "revoked True", a["outcome"]
    assert b["outcome"] == "raised RuntimeError: injected load failure"
    assert a["device_hit"] == b["device_hit"] == 0  # loaded on neither
