"""The scheduler's estimate of how long a load from kvdepot keeps a request waiting."""

from kvdepot.integrations.vllm.load_time import PRIOR_FIXED_S, LoadTime, load_pays


def timed(samples: list[tuple[int, float]]) -> LoadTime:
    load = LoadTime()
    for i, (tokens, seconds) in enumerate(samples):
        load.planned(str(i), tokens, now=100.0)
        load.received(str(i), now=100.0 + seconds)
    return load


def test_a_line_through_loads_of_several_sizes_gives_the_fixed_and_per_token_parts() -> None:
    load = timed([(1000, 0.003), (2000, 0.005), (4000, 0.009)])
    assert abs(load.estimate(0) - 0.001) < 1e-9
    assert abs(load.estimate(8000) - 0.017) < 1e-9


def test_before_any_load_the_prior_is_fixed_only() -> None:
    assert LoadTime().estimate(10_000) == PRIOR_FIXED_S


def test_loads_of_one_size_count_whole_as_fixed() -> None:
    load = timed([(8192, 0.02), (8192, 0.03)])
    assert abs(load.estimate(15) - 0.025) < 1e-9


def test_a_load_never_planned_or_forgotten_gives_no_sample() -> None:
    load = LoadTime()
    load.received("never")
    load.planned("gone", 100, now=1.0)
    load.forget("gone")
    load.received("gone", now=9.0)
    assert load.estimate(100) == PRIOR_FIXED_S


def test_a_load_pays_only_when_it_arrives_sooner_than_the_engine_computes() -> None:
    load = timed([(8192, 0.010)])  # a load keeps a request waiting 10 ms
    # 15 tokens at 20,000 tokens/s: 0.75 ms of compute, far less than the load.
    assert not load_pays(15, 20_000.0, load)
    # 8,192 tokens at 20,000 tokens/s: 410 ms of compute.
    assert load_pays(8192, 20_000.0, load)
    # No prefill rate measured yet: load, as before anything was timed.
    assert load_pays(15, None, load)
    assert not load_pays(0, 20_000.0, load)
