"""The planner's backward pass: the gradient flowing back through the layers, views, the batch.

The trace and the walk over backward against sizes computed by hand; one of our examples'
models (``keras_fit.py``'s CNN: activations larger than its parameters, layers without
parameters between those with) against the measured peak of live tensor bytes of a real job of
two processes under FSDP ZeRO-3 (``workers/planner_memory.py``).
"""

from __future__ import annotations

import pytest
import torch

from stratagem.distribute.planner import trace_model
from stratagem.distribute.planner.cost_model import backward_moment
from test_planner import measured_peaks


def test_backward_holds_each_layers_input_gradient_and_counts_a_view_once():
    """Linear, ReLU, Unflatten, Flatten, Linear on a 5x8 batch, in float32 bytes by hand."""
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Unflatten(1, (4, 4)),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 4),
    )
    facts = trace_model(model, torch.randn(5, 8))
    hidden = 4 * 5 * 16
    # The batch apart; ReLU saves its output, and the last Linear saves a view of that same
    # output (through Unflatten and Flatten): one tensor of memory, counted once.
    assert facts.batch_bytes == 4 * 5 * 8
    assert facts.activation_bytes == hidden
    # Backward makes the gradient of each layer's input: none for the first Linear (nothing
    # before it trains), none for the views (their gradients are views of their outputs').
    assert [x.grad_bytes for x in facts.layers] == [0, hidden, 0, 0, hidden]
    # The largest moment is ReLU's backward: its saved output, the gradient of its output
    # (made by the last Linear's backward), the gradient of its input, and the last Linear's
    # parameter gradients.
    assert backward_moment(facts) == (3 * hidden, 4 * (16 * 4 + 4))


@pytest.mark.multiprocess
def test_an_examples_cnn_under_zero3_is_within_5_percent_of_the_measured_peak(tmp_path):
    """keras_fit.py's CNN on 2 processes under the ZeRO-3 the planner builds: the peak is in
    backward, when ReLU's saved output and its input's and output's gradients are alive, and
    FSDP holds the last collectives of the units with parameters (a tighter bound than the
    planner's 15%: without either term the prediction is 0.75 or 0.88 of the peak)."""
    for rank, found in enumerate(measured_peaks(tmp_path, "keras_cnn", "zero3")):
        ratio = found["predicted"] / found["measured"]
        assert 0.95 <= ratio <= 1.05, (rank, found)
