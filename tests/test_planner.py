"""``sg.distribute.plan`` and ``auto``: the trace, the cost model, the chooser, the errors.

The chooser is checked against the same cost model enumerated exhaustively (every split of a
pipeline, not only the balanced ones) over a table of 200+ cases; the trace against sizes
computed by hand; the memory prediction against the measured peak of live tensor bytes in a
real job of two processes (``workers/planner_memory.py``); the plan's HSDP against one process
on the global batch (``workers/planner_hsdp.py``).
"""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from real_models import hf_models
from stratagem.distribute.planner import ClusterShape, PlanDoesNotFitError, trace_model
from stratagem.distribute.planner.candidates import candidates
from stratagem.distribute.planner.choose import choose

MiB = 2**20


def _mlp(width: int = 64, depth: int = 4) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 3))


def _lm_batch(n: int = 4) -> dict[str, torch.Tensor]:
    ids = hf_models.tokens(n)
    return {"input_ids": ids, "labels": ids}


def test_trace_counts_parameters_and_saved_activations_as_by_hand():
    """Linear saves its input, Tanh its output; parameters are not activations; the meta trace
    touches no real memory and leaves the model as it was."""
    model, batch = _mlp(width=8, depth=2), torch.randn(5, 8)
    before = [p.clone() for p in model.parameters()]
    facts = trace_model(model, batch)
    params = 4 * (2 * (8 * 8 + 8) + 8 * 3 + 3)
    # Each Linear saves its input (for its weight's gradient), each Tanh its output; the Tanhs'
    # outputs are the next Linears' inputs, the same tensors: two outputs, 5x8; the batch, which
    # the first Linear saves, is counted apart (the loop holds it all step).
    assert facts.param_bytes == facts.trainable_bytes == params
    assert (facts.activation_bytes, facts.batch_bytes) == (4 * 5 * 8 * 2, 4 * 5 * 8)
    assert [x.path for x in facts.layers] == [str(i) for i in range(5)]
    assert facts.layers_are_sequential and facts.megatron_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_trace_counts_a_tied_parameter_once_and_finds_megatron_projections():
    """GPT-2's lm_head is its embedding: one parameter; its c_attn/c_fc (column) and c_proj
    (row) projections are what Megatron splits, and each row projection's output (batch x
    seq x width floats) is all-reduced."""
    model = hf_models.gpt2()
    facts = trace_model(model.train(), _lm_batch())
    unique = {id(p): p for p in model.parameters()}
    assert facts.param_bytes == sum(p.numel() * 4 for p in unique.values())
    blocks = [m for n, m in model.named_modules() if n.endswith((".c_attn", ".c_fc", ".c_proj"))]
    assert facts.megatron_bytes == sum(p.numel() * 4 for m in blocks for p in m.parameters())
    assert facts.megatron_allreduce_bytes == 2 * 2 * 4 * hf_models.SEQ * 32 * 4  # 2 layers x 2
    assert [x.path for x in facts.layers] == ["transformer.h.0", "transformer.h.1"]


def test_communication_per_step_is_the_ring_formulas():
    """MWMS sends 2(W-1)/W of the gradients; ZeRO-3 gathers the parameters twice and
    reduce-scatters the gradients, (W-1)/W each; ZeRO-2 gathers once."""
    facts = trace_model(_mlp(), torch.randn(4, 64))
    g = facts.trainable_bytes
    found = {c.name: c for c in candidates(facts, ClusterShape(1, 4), slots=2)}
    assert found["MultiWorkerMirrored"].bytes_per_step == pytest.approx(2 * 3 / 4 * g)
    assert found["FSDP ZeRO-3"].bytes_per_step == pytest.approx(3 * 3 / 4 * g)
    assert found["FSDP ZeRO-2"].bytes_per_step == pytest.approx(2 * 3 / 4 * g)
    m = found["FSDP ZeRO-3"].memory
    # At its largest moment (in backward here) a device holds a quarter of the parameters and
    # of the optimizer state, and at most a quarter of the gradients.
    assert (m.params, m.optimizer) == (g // 4, 2 * (g // 4)) and m.grads <= g // 4


class _Towers(torch.nn.Module):
    """Parallel towers, summed: no layers to pipeline, no projection Megatron splits; only data
    parallelism and sharding (each tower an FSDP unit) apply."""

    def __init__(self, width: int = 64, towers: int = 8) -> None:
        super().__init__()
        for i in range(towers):
            self.add_module(f"tower{i}", torch.nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(tower(x) for tower in self.children())


def _base_models() -> dict[str, object]:
    return {
        "towers": trace_model(_Towers(), torch.randn(4, 64)),
        "gpt2": trace_model(hf_models.gpt2().train(), _lm_batch()),
        "llama": trace_model(hf_models.llama().train(), _lm_batch()),
        "bert": trace_model(
            hf_models.bert().train(),
            {"input_ids": hf_models.tokens(4), "labels": hf_models.labels(4, 3)},
        ),
        "resnet": trace_model(
            hf_models.resnet().train(),
            {"pixel_values": hf_models.images(4), "labels": hf_models.labels(4, 4)},
        ),
    }


# Models from tens of MB to a few GB of parameters, batches from 1x to 64x the traced one,
# worlds up to 64 devices on one or several hosts, budgets from generous to impossible.
WIDTHS = (300.0, 3000.0, 30000.0)
BATCHES = (1.0, 64.0)
CLUSTERS = ((1, 2), (1, 8), (2, 4), (8, 8), (4, 16))
BUDGETS = (0.15, 0.5, 2.0)


def test_the_chooser_fits_and_is_within_ten_percent_of_exhaustive_search():
    """For every case the chosen plan fits its budget and sends at most 10% more per step than
    the best of every plan the same cost model prices (every pipeline split enumerated); when
    no plan fits, the error's shortfall is the smallest any plan misses by."""
    cases = slowest = 0.0
    chosen_kinds = set()
    for (name, base), width, batch, (hosts, per_host), budget in itertools.product(
        _base_models().items(), WIDTHS, BATCHES, CLUSTERS, BUDGETS
    ):
        facts = base.scaled(width, batch)
        whole = facts.param_bytes * 4 + facts.activation_bytes  # MWMS with Adam, roughly
        cluster = ClusterShape(hosts, per_host, int(budget * whole))
        every = list(candidates(facts, cluster, slots=2, exhaustive=True))
        fitting = [c for c in every if c.fits]
        start = time.perf_counter()
        try:
            plan = choose(facts, cluster, slots=2)
        except PlanDoesNotFitError as e:
            assert not fitting, (name, width, batch, hosts, per_host, budget, e)
            assert e.shortfall == min(c.shortfall for c in every)
        else:
            assert fitting, (name, width, batch, hosts, per_host, budget)
            best = min(c.bytes_per_step for c in fitting)
            assert plan.chosen.memory.peak <= cluster.memory_per_device
            assert plan.chosen.bytes_per_step <= 1.1 * best, (name, str(plan))
            chosen_kinds.add(plan.chosen.kind)
        slowest = max(slowest, time.perf_counter() - start)
        cases += 1
    assert cases >= 200
    assert slowest < 2.0
    # the table exercises the choice: more than one kind of plan wins somewhere
    assert len(chosen_kinds) >= 3, chosen_kinds


def test_a_model_that_fits_nowhere_is_a_named_error_with_the_smallest_shortfall():
    model, batch = _mlp(width=256), torch.randn(8, 256)
    facts = trace_model(model, batch)
    budget = 1000
    cluster = ClusterShape(1, 4, budget)
    smallest = min(c.memory.peak for c in candidates(facts, cluster, slots=2)) - budget
    with pytest.raises(PlanDoesNotFitError, match="no plan fits") as caught:
        sg.distribute.plan(model, batch, 4, memory_per_device=budget)
    assert caught.value.shortfall == smallest
    assert f"short by {smallest / MiB:,.1f} MiB" in str(caught.value)


def test_the_printed_plan_lists_every_candidate_and_marks_the_chosen_one():
    plan = sg.distribute.plan(
        hf_models.gpt2().train(), _lm_batch(), ClusterShape(2, 2), memory_per_device=64 * MiB
    )
    table = str(plan)
    for c in plan.candidates:
        assert c.name in table
    chosen = [line for line in table.splitlines() if line.startswith("*")]
    assert len(chosen) == 1 and plan.chosen.name in chosen[0]


def test_a_cluster_spec_is_grouped_into_hosts_by_address():
    from stratagem.distribute.planner.choose import cluster_shape

    spec = sg.train.ClusterSpec({"chief": ["a:1"], "worker": ["a:2", "b:1", "b:2"]})
    assert cluster_shape(spec, 2**30) == ClusterShape(2, 2, 2**30)
    assert cluster_shape(8, 2**30) == ClusterShape(1, 8, 2**30)


def test_bad_arguments_are_named_errors():
    with pytest.raises(ValueError, match="devices_or_cluster"):
        sg.distribute.plan(_mlp(), torch.randn(2, 64), "four")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        sg.distribute.plan(_mlp(), torch.randn(2, 64), 2, optimizer="lamb")


# Config sizes of the two models whose peak is measured: about 12 MiB of parameters each, so
# that tensors, not the interpreter, make the peak, and a job takes a few seconds.
MEASURED = {
    "bert": ["hidden_size=256", "num_hidden_layers=4", "num_attention_heads=4"],
    "llama": [
        "hidden_size=256",
        "intermediate_size=704",
        "num_hidden_layers=4",
        "num_attention_heads=4",
        "num_key_value_heads=4",
    ],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["mirrored", "zero3"])
@pytest.mark.parametrize("name", sorted(MEASURED))
def test_predicted_peak_is_within_15_percent_of_the_measured_peak(tmp_path, name, kind):
    """Two processes train under the strategy the planner builds (MultiWorkerMirrored, or FSDP
    ZeRO-3); each reads its peak of live tensor bytes from torch's profiler memory events and
    writes it beside the plan's prediction (``workers/planner_memory.py``)."""
    for rank, found in enumerate(measured_peaks(tmp_path, name, kind, *MEASURED[name])):
        ratio = found["predicted"] / found["measured"]
        assert 0.85 <= ratio <= 1.15, (rank, found)


def measured_peaks(tmp_path, name: str, kind: str, *sizes: str) -> list[dict]:
    """Run the planner's memory check on two processes (``workers/planner_memory.py``): what
    each rank wrote, its predicted and measured peaks."""
    args = [name, kind, str(tmp_path), *sizes]
    results = run_cluster(WORKERS / "planner_memory.py", 2, tmp_path, args=args, timeout=240)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((tmp_path / f"{kind}-rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.multiprocess
def test_the_plans_hsdp_trains_as_one_process_on_the_global_batch(tmp_path):
    """Four processes build the plan's "HSDP 2x2" candidate as ``auto`` builds a choice
    (``Plan.build``): a (replicate 2, shard 2) mesh, each parameter sharded over 2. Two SGD
    steps, each process on its quarter of the global batch, leave the parameters one process
    gets alone on the whole batch (``workers/planner_hsdp.py``)."""
    results = run_cluster(
        WORKERS / "planner_hsdp.py", 4, tmp_path, args=[str(tmp_path), "2", "2"], timeout=240
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads((tmp_path / f"hsdp-rank{r}.json").read_text()) for r in range(4)]
    for f in found:
        assert f["mesh"] == {"replicate": 2, "shard": 2} and f["replicas"] == 4
        assert f["local_shapes"]["0.weight"] == [8, 6]  # 16 rows over the 2 shards, not 4
    assert found[0]["close"], found[0]


def test_auto_builds_the_chosen_strategy():
    """On one device the only plan is MultiWorkerMirroredStrategy, built and usable."""
    model = _mlp(width=16)
    strategy = sg.distribute.auto(model, torch.randn(4, 16), 1, memory_per_device=2**30)
    assert isinstance(strategy, sg.distribute.MultiWorkerMirroredStrategy)
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        built = _mlp(width=16)
    with torch.no_grad():
        out = strategy.run(lambda: built(torch.ones(2, 16)).sum())
        assert float(out) == pytest.approx(float(built(torch.ones(2, 16)).sum()))
