"""``fit`` going on in place after a lost peer, its arithmetic alone (one process, in-process):
the strategy's side of it (``offer_in_place``, ``rejoin``: the group rebuilt, the newest state
handed round) is stood in for, and a peer's loss is raised by the model's forward inside an
execution of two steps, after the first committed. The fit must go back to the execution's
start and past the one step committed (as every survivor does when the newest holder
committed it), then redo the failed step: its weights then equal an uninterrupted fit's. The
processes' side is ``test_elastic_jobs.py``'s."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from keras_utils import compiled
from workers.common import build_model, keras_data


class LosesAPeer(torch.nn.Module):
    """The model, whose training forward number ``at`` raises ``MembershipChanged`` once."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.net = build_model()
        self.calls, self.at = 0, at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                raise sg.errors.MembershipChanged("worker 2 lost (a stand-in)")
        return self.net(x)


def _fit(module, data: str, monkeypatch=None, rejoined=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = compiled(module)
    model.compile(
        sg.keras.optimizers.SGD(0.1, momentum=0.9),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=2,
    )
    if monkeypatch is not None:
        extended = model.distribute_strategy.extended

        def rejoin(state, committed):  # the one survivor is the newest holder: nothing moves
            rejoined.append((int(state[0]), committed))
            return "continued with 1 of 2 workers; worker 1 lost: a stand-in"

        monkeypatch.setattr(extended, "offer_in_place", lambda: True)
        monkeypatch.setattr(extended, "rejoin", rejoin)
    x, y = keras_data(96)
    if data == "arrays":
        model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    else:
        batches = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=3).batch(12)
        model.fit(batches.repeat(2), epochs=1, verbose=0)
    net = module.net if isinstance(module, LosesAPeer) else module
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_a_loss_after_a_committed_step_goes_on_past_it_and_redoes_the_failed_one(
    data, monkeypatch, capsys
):
    """Forward 6 fails: the third execution (steps 4 and 5), after step 4 committed. The fit
    goes back to step 4's start, past it (one step committed), redoes step 5: the weights of
    an uninterrupted fit, not of one that trained step 4 twice or skipped step 5."""
    torch.manual_seed(0)
    initial = build_model().state_dict()
    module = LosesAPeer(at=6)
    module.net.load_state_dict(initial)
    reference_module = build_model()
    reference_module.load_state_dict(initial)
    rejoined: list[tuple[int, int]] = []
    got = _fit(module, data, monkeypatch, rejoined)
    want = _fit(reference_module, data)
    assert rejoined == [(5, 5)], rejoined  # steps 0-4 committed when the peer was lost
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert "went on in place at step 5" in capsys.readouterr().out
