import math

import pytest

from autotune.probe.search import Measurement, estimated_max, largest_fitting


class Device:
    """A fake device: a peak-memory curve and a budget; records every real step it runs."""

    def __init__(self, peak, budget):
        self.peak = peak
        self.budget = budget
        self.real_calls = []

    def real(self, b):
        self.real_calls.append(b)
        p = self.peak(b)
        # an OOM stops the step early: only a lower bound of the peak is seen
        return Measurement(p <= self.budget, p if p <= self.budget else self.budget + 1)

    def true_max(self, upper):
        return max((b for b in range(1, upper + 1) if self.peak(b) <= self.budget), default=0)


CURVES = {
    "linear": lambda b: 1_000_000 + 37_000 * b,
    "step-then-linear": lambda b: max(3_000_000, 1_000_000 + 37_000 * b),  # optimizer step dominates small b
    "rounded-2MiB": lambda b: math.ceil((1_000_000 + 37_000 * b) / 2**21) * 2**21,
    "quadratic": lambda b: 1_000_000 + 20_000 * b + 40 * b * b,
}


@pytest.mark.parametrize("curve", CURVES, ids=str)
@pytest.mark.parametrize("budget", [2_500_000, 5_000_000, 9_999_999, 40_000_000])
@pytest.mark.parametrize("upper", [1, 7, 256, 1000])
def test_exact_estimates_need_one_real_step(curve, budget, upper):
    peak = CURVES[curve]
    device = Device(peak, budget)
    result = largest_fitting(device.real, upper=upper, budget=budget, estimate=peak)
    truth = device.true_max(upper)
    assert result.batch_size == truth
    assert len(device.real_calls) == (1 if truth else 1)  # one real step confirms or refutes
    assert max(device.real_calls) <= upper


@pytest.mark.parametrize("curve", CURVES, ids=str)
@pytest.mark.parametrize("overhead", [1.0, 1.03, 1.1, 1.2, 0.9])
@pytest.mark.parametrize("budget", [5_000_000, 12_345_678, 40_000_000])
def test_estimates_off_by_allocator_overhead(curve, overhead, budget):
    # Real steps cost more (or less) than estimated, as on CUDA: the search still returns a size
    # that fitted for real, within 5 % of the truth, in a handful of real steps.
    estimate = CURVES[curve]
    device = Device(lambda b: int(estimate(b) * overhead) + 50_000, budget)
    result = largest_fitting(device.real, upper=512, budget=budget, estimate=estimate)
    truth = device.true_max(512)
    assert result.batch_size <= truth
    assert result.batch_size >= math.floor(0.95 * truth)
    assert result.batch_size == 0 or device.real(result.batch_size).fits
    assert len(device.real_calls) <= 5 + 1  # +1: the check above


@pytest.mark.parametrize("curve", CURVES, ids=str)
@pytest.mark.parametrize("budget", [2_500_000, 12_345_678, 40_000_000])
def test_without_estimates(curve, budget):
    device = Device(CURVES[curve], budget)
    result = largest_fitting(device.real, upper=300, budget=budget)
    truth = device.true_max(300)
    assert math.floor(0.95 * truth) <= result.batch_size <= truth
    assert len(device.real_calls) <= 8


def test_nothing_fits():
    device = Device(lambda b: 10_000 + b, 5_000)
    result = largest_fitting(device.real, upper=64, budget=5_000, estimate=lambda b: 10_000 + b)
    assert result.batch_size == 0
    assert result.smallest_failure == 1
    assert device.real_calls == [1]  # the estimate says no, one real step confirms


def test_estimate_too_pessimistic_still_tries_one_sample():
    # The estimate says one sample is over budget, but the device fits 40.
    device = Device(lambda b: 100 * b, 4_000)
    result = largest_fitting(device.real, upper=64, budget=4_000, estimate=lambda b: 10_000 + 100 * b)
    assert result.batch_size == 40


def test_estimated_max_uses_few_estimates():
    calls = []

    def est(b):
        calls.append(b)
        return 1_000 + 10 * b

    size, points = estimated_max(est, 5_000, 10_000)
    assert size == 400
    assert len(calls) <= 5
    assert set(points) == set(calls)


def test_upper_must_be_positive():
    with pytest.raises(ValueError, match="upper"):
        largest_fitting(lambda b: Measurement(True, 0), upper=0, budget=10)


@pytest.mark.parametrize("lower", [1, 2])
def test_within_allocator_finds_the_largest_size_served_and_asks_few_sizes_near_the_tensors_size(lower):
    from autotune.memory.allocator import AllocatorPeaks
    from autotune.probe.search import within_allocator

    for size in (lower, lower + 1, 7, 62, 1491):
        for served in sorted({0, lower, size - 2, size - 1, size, *range(0, size, max(1, size // 40))}):
            asked = []

            def allocator(b, cap, served=served):
                asked.append(b)
                return AllocatorPeaks(b, b, out_of_memory=b > served)

            found, _ = within_allocator(allocator, size, 10**9, lower=lower)
            assert found == (served if served >= lower else 0), (size, served)
            # down from the size in doubling steps, then bisected: about twice the log of the distance
            assert len(set(asked)) <= 2 * math.ceil(math.log2(size - min(served, size) + 1)) + 2, (size, served, asked)
