"""Load or compute: a tier's measured speed, the prefix worth loading, and the engine's
prefill rate measured from its scheduler's steps."""

from __future__ import annotations

import pytest

from kvdepot.integrations.vllm.prefill_rate import PrefillRate
from kvdepot.storage.load_speed import TierSpeed, chunks_worth_loading

MB = 1_000_000


def measured(round_trip: float, bytes_per_s: float) -> TierSpeed:
    speed = TierSpeed()
    speed.observe_round_trip(round_trip)
    speed.observe_read(int(bytes_per_s), 1.0 + round_trip)
    return speed


def test_a_read_is_expected_to_cost_its_round_trip_plus_its_bytes_at_the_measured_rate():
    speed = measured(0.002, 100 * MB)
    assert speed.read_seconds(50 * MB) == pytest.approx(0.502)
    assert speed.status() == {"read_bytes_per_s": 100 * MB, "round_trip_ms": 2.0}


def test_a_tier_never_measured_is_assumed_to_pay_off():
    assert TierSpeed().read_seconds(1 << 30) is None
    assert chunks_worth_loading([{"remote": 1 << 30}] * 3, {"remote": TierSpeed()}, 1e-6) == 3


def test_a_tiny_read_cannot_make_a_tier_look_infinitely_fast():
    speed = TierSpeed()
    speed.observe_round_trip(0.010)
    speed.observe_read(4096, 0.010)  # all round trip: transfer time counted as a quarter
    assert speed.bytes_per_s() == pytest.approx(4096 / 0.0025)


def test_the_slower_of_fresh_read_and_write_figures_is_trusted_and_stale_ones_give_way(
        monkeypatch):
    import kvdepot.storage.load_speed as load_speed

    now = [1000.0]
    monkeypatch.setattr(load_speed.time, "monotonic", lambda: now[0])
    speed = TierSpeed()
    speed.observe_read(1000 * MB, 1.0)
    now[0] += 10
    speed.observe_write(10 * MB, 1.0)  # the link slowed down: the writes see it first
    assert speed.bytes_per_s() == pytest.approx(10 * MB)
    now[0] += load_speed.FRESH_S
    speed.observe_write(1000 * MB, 1.0)  # and see it recover, the reads being stale
    assert speed.bytes_per_s() == pytest.approx(2 / (1 / (10 * MB) + 1 / (1000 * MB)))
    now[0] += load_speed.FRESH_S
    assert speed.bytes_per_s() == pytest.approx(2 / (1 / (10 * MB) + 1 / (1000 * MB)))


def test_one_slow_batch_weighs_what_it_costs():
    speed = TierSpeed()
    speed.observe_write(1000 * MB, 1.0)
    speed.observe_write(1 * MB, 1.0)
    # Averaged per byte: about 2 MB/s, where an average of rates would say 500 MB/s.
    assert speed.bytes_per_s() == pytest.approx(2 / (1 / (1000 * MB) + 1 / MB))


def test_the_longest_prefix_that_loads_faster_than_it_computes_is_chosen():
    # 4 MB per chunk at 100 MB/s with a 50 ms round trip: k chunks load in 0.05 + 0.04 k s.
    speeds = {"remote": measured(0.050, 100 * MB)}
    chunks = [{"remote": 4 * MB}] * 8
    assert chunks_worth_loading(chunks, speeds, compute_seconds_per_chunk=0.03) == 0
    # At 0.05 s per chunk computed, one chunk does not pay the round trip; five do.
    assert chunks_worth_loading(chunks, speeds, compute_seconds_per_chunk=0.05) == 8
    assert chunks_worth_loading(chunks[:4], speeds, compute_seconds_per_chunk=0.0499) == 0
    assert chunks_worth_loading(chunks, speeds, compute_seconds_per_chunk=0.0499) == 8


def test_chunks_already_in_cpu_memory_cost_nothing_and_tiers_add_up():
    speeds = {"disk": measured(0.0, 1000 * MB), "remote": measured(0.0, 10 * MB)}
    # CPU, CPU, disk, remote: the remote chunk takes 0.4 s of the 0.4 s four chunks compute.
    chunks = [{}, {}, {"disk": 4 * MB}, {"remote": 4 * MB}]
    assert chunks_worth_loading(chunks, speeds, compute_seconds_per_chunk=0.1041) == 4
    assert chunks_worth_loading(chunks, speeds, compute_seconds_per_chunk=0.1) == 3


def test_prefill_rate_comes_from_busy_steps_that_loaded_nothing():
    rate = PrefillRate(min_tokens=256)
    rate.step(1024, frozenset({"a"}), loaded=False, now=0.0)
    rate.step(1, frozenset({"a"}), loaded=False, now=0.5)  # "a" goes on: the gap was busy
    assert rate.tokens_per_s == pytest.approx(2048)
    rate.step(4096, frozenset({"b"}), loaded=True, now=0.6)  # decode step: too few tokens
    rate.step(1, frozenset({"b"}), loaded=False, now=0.7)  # after a load: not compute alone
    rate.step(2048, frozenset({"c"}), loaded=False, now=0.8)
    rate.step(1024, frozenset({"d"}), loaded=False, now=60.0)  # "c" ended: maybe idle since
    assert rate.tokens_per_s == pytest.approx(2048)
    rate.step(1, frozenset({"d"}), loaded=False, now=61.0)
    assert rate.tokens_per_s == pytest.approx(2048 + 0.3 * (1024 - 2048))


def test_with_asynchronous_scheduling_a_step_is_timed_by_the_gap_after_the_next_build():
    """vLLM's batch queue under asynchronous scheduling: the step after a prefill is built
    at once, the one after that when the prefill's output is in."""
    rate = PrefillRate(min_tokens=256, steps_in_flight=2)
    rate.step(4096, frozenset({"a"}), loaded=False, now=0.0)  # queued
    rate.step(1, frozenset({"a"}), loaded=False, now=0.001)  # queued behind it at once
    assert rate.tokens_per_s is None  # 0.001 s is no step's time
    rate.step(1, frozenset({"a"}), loaded=False, now=0.201)  # the prefill's output is in
    assert rate.tokens_per_s == pytest.approx(4096 / 0.2)
    # A request that ends with its prefill says nothing: the engine may idle after it.
    rate.step(2048, frozenset({"b"}), loaded=False, now=5.0)
    rate.step(0, frozenset(), loaded=False, now=5.001)
    rate.step(2048, frozenset({"c"}), loaded=False, now=9.0)
    rate.step(1, frozenset({"c"}), loaded=False, now=9.001)
    assert rate.tokens_per_s == pytest.approx(4096 / 0.2)
    rate.step(1, frozenset({"c"}), loaded=False, now=9.051)
    assert rate.tokens_per_s == pytest.approx(4096 / 0.2 + 0.3 * (2048 / 0.05 - 4096 / 0.2))


def test_until_a_step_is_measured_a_request_ending_with_its_prefill_gives_a_first_rate():
    """An engine whose requests ask for one token: under asynchronous scheduling no gap
    between builds times a prefill (the request is gone by the next build), so its end
    does, from the build of its last step."""
    rate = PrefillRate(min_tokens=256, steps_in_flight=2)
    rate.step(4096, frozenset({"aborted"}), loaded=False, now=0.0)
    rate.finished("aborted", completed=False, now=0.001)  # at no step's output
    rate.step(4096, frozenset({"loaded"}), loaded=True, now=1.0)
    rate.finished("loaded", completed=True, now=1.1)  # the step read KV: not compute alone
    rate.step(4096, frozenset({"chat"}), loaded=False, now=2.0)
    rate.step(1, frozenset({"chat"}), loaded=False, now=2.001)
    rate.finished("chat", completed=True, now=2.3)  # its last step was a decode step
    rate.finished("never built", completed=True, now=2.4)
    assert rate.tokens_per_s is None
    rate.step(2048, frozenset({"one", "two"}), loaded=False, now=3.0)
    rate.finished("one", completed=True, now=3.1)
    assert rate.tokens_per_s == pytest.approx(2048 / 0.1)
    # Once a rate is known, ends add nothing: steps queued ahead would count in their time.
    rate.finished("two", completed=True, now=3.5)
    assert rate.tokens_per_s == pytest.approx(2048 / 0.1)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf"), 2e9, "fast"])
def test_a_lookup_with_a_nonsense_prefill_rate_is_refused_as_malformed(rate):
    import msgspec

    from kvdepot.protocol import (
        REQUEST_DECODERS,
        KeyScope,
        Lookup,
        RequestType,
        describe_validation_error,
        pack_ints,
    )

    decode = REQUEST_DECODERS[RequestType.LOOKUP].decode
    good = Lookup(request_id="r", scope=KeyScope("m", 1, ""), token_ids=pack_ints(range(8)),
                  prefill_tokens_per_s=5000.0)
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(good))
    assert decode(msgspec.msgpack.encode(fields)).prefill_tokens_per_s == 5000.0
    fields[[f.name for f in msgspec.structs.fields(Lookup)].index("prefill_tokens_per_s")] = rate
    with pytest.raises(msgspec.ValidationError) as refused:
        decode(msgspec.msgpack.encode(fields))
    assert describe_validation_error(Lookup, refused.value).startswith("prefill_tokens_per_s:")
