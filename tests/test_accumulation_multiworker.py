"""Gradient accumulation and 16-bit compressed all-reduce across 2 real MWMS workers, with the
bytes each step sends counted through the communicator (counted, never timed)."""

from __future__ import annotations

import pytest
import torch

from cluster_utils import WORKERS, run_cluster

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("accumulation")
    results = run_cluster(WORKERS / "accumulation_checks.py", 2, workdir, timeout=180)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        assert "Traceback" not in r.stderr
    return [torch.load(workdir / f"result-{i}.pt") for i in range(2)]


def _close(a: dict, b: dict) -> None:
    for k in b:
        torch.testing.assert_close(a[k], b[k], msg=k)


@pytest.mark.parametrize("variant", ["accumulated", "deferred_to_step", "every_pass"])
def test_four_micro_batches_give_one_step_on_the_four_times_batch(outs, variant):
    for out in outs:
        _close(out[variant]["grads"], out["whole"]["grads"])
        _close(out[variant]["weights"], out["whole"]["weights"])
    # Both workers hold the same weights (they summed the same gradients).
    _close(outs[0][variant]["weights"], outs[1][variant]["weights"])


def test_an_accumulated_step_sends_what_one_step_sends(outs):
    for out in outs:
        whole, accumulated = out["whole"], out["accumulated"]
        assert whole["bytes"] > 0
        assert accumulated["bytes"] == whole["bytes"]
        assert accumulated["all_reduces"] == whole["all_reduces"]
        assert out["deferred_to_step"]["bytes"] == whole["bytes"]
        # Without accumulate_gradients() each backward reduces: four times the bytes.
        assert out["every_pass"]["bytes"] == 4 * whole["bytes"]


def test_fit_with_gradient_accumulation_steps_matches_the_four_times_batch(outs):
    for out in outs:
        accumulated, whole = out["fit_accumulated"], out["fit_whole"]
        assert accumulated["iterations"] == whole["iterations"] == 2
        _close(accumulated["weights"], whole["weights"])
        # One gradient reduction per optimizer step, of the two models built in the scope
        # (the reducer covers both): 2 steps of 2 * 431 float32 values (419 gradients and two
        # flags for each of the 6 parameters: gradient made, parameter held).
        assert accumulated["bytes"] == whole["bytes"] == 2 * 2 * 431 * 4


def test_compression_off_is_the_plain_float32_sum_bit_for_bit(outs):
    for out in outs:
        for k, g in out["manual_sum"].items():
            assert torch.equal(out["fp32"][k], g), k


def test_bf16_sum_is_the_float32_sum_of_the_sent_values_rounded_once(outs):
    a, b = outs
    for k in a["bf16"]:
        peers = a["peer_local_grads"][k]
        sent = [p.to(torch.bfloat16).float() for p in peers]
        once = (sent[0] + sent[1]).to(torch.bfloat16).float()
        assert torch.equal(a["bf16"][k], once), k
        assert torch.equal(b["bf16"][k], once), k
        exact = peers[0] + peers[1]
        bound = (peers[0].abs() + peers[1].abs() + exact.abs()) * 2**-8
        assert bool(((a["bf16"][k] - exact).abs() <= bound).all()), k


def test_compressed_buckets_send_half_the_bytes(outs):
    for out in outs:
        # The model's one bucket holds 419 values and 12 flags (two per parameter), padded to
        # 432 for 2 chunks. fp16: the 419 values in 2 chunks of 210 and an exponent each, the
        # flags apart in float32.
        assert out["fp32_bytes"] == 431 * 4
        assert out["bf16_bytes"] == 432 * 2
        assert out["fp16_bytes"] == 422 * 2 + 12 * 4
        for k, g in out["fp32"].items():
            torch.testing.assert_close(out["fp16"][k], g, rtol=2**-10, atol=g.abs().max() * 2**-10)


def test_fp16_compression_keeps_gradients_below_fp16s_range(outs):
    for out in outs:
        for k, g in out["fp32_tiny"].items():
            assert 0 < g.abs().max() < 6e-8, k  # all of them below fp16's smallest normal
            torch.testing.assert_close(
                out["fp16_tiny"][k], g, rtol=2**-10, atol=g.abs().max() * 2**-10
            )


def test_the_last_backward_sends_while_it_runs_and_the_others_send_nothing(outs):
    for out in outs:
        *deferred, (mid, total) = out["overlap"]
        assert deferred == [(0, 0)] * 3
        # The last layers' buckets went out before backward reached the first layer.
        assert 0 < mid < total, out["overlap"]


def test_workers_that_fill_one_hosts_cores_send_their_gradients_in_one_pack(outs):
    # bytes_per_pack=0 (TF's "automatic"), all on one host, the workers' threads filling its
    # cores: one all-reduce for a model that explicit 4 MiB buckets would send in two.
    for out in outs:
        assert out["wide_all_reduces"] == 1
