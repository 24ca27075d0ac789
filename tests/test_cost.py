"""The cost record of a run: peak resident memory that sees an allocation and resets, and how shared images count."""
import pytest
import torch

from fewclip.training.cost import MiB, RunCost, peak_rss_bytes, reset_peak_rss, rss_bytes


def test_peak_rss_sees_an_allocation_and_resets():
    if not reset_peak_rss():
        pytest.skip("the peak resident memory cannot be reset on this system")
    base = peak_rss_bytes()
    assert abs(base - rss_bytes()) < 64 * MiB  # just reset: the peak is about what is resident now
    x = torch.ones(50 * 2**18)  # 50 MiB of float32, written so every page is resident
    peak = peak_rss_bytes()
    assert peak - base >= 40 * MiB
    del x
    assert reset_peak_rss() and peak_rss_bytes() <= peak - 30 * MiB  # the 50 MiB were given back


def test_shared_images_are_charged_in_full_and_counted_apart():
    cost = RunCost(torch.device("cpu"))
    cost.count_images(40)  # encoded by this run
    cost.count_images(100, encoded=30)  # 70 of them from a cache filled by another run
    cost.train_time_s += 1.5
    rec = cost.record(trainable_parameters=1024)
    assert (rec["images_encoded"], rec["images_encoded_shared"]) == (140, 70)
    assert rec["train_time_s"] == 1.5 and rec["trainable_parameters"] == 1024 and rec["peak_cuda_mib"] is None
    assert rec["wall_time_s"] >= 0 and rec["peak_rss_mib"] > 0
