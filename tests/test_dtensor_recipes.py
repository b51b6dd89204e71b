"""LayoutMap in one process: a weight reached by several paths (tied embeddings) is laid out
once, for all of them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stratagem import dtensor
from stratagem.dtensor import UNSHARDED, Layout, LayoutError, LayoutMap

U = UNSHARDED


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    mesh = dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    yield mesh
    dist.destroy_process_group()  # other test modules start their own groups


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(8, 4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight


def test_a_tied_weight_is_laid_out_once_for_all_its_paths(mesh):
    model = TiedModel()
    layout_map = LayoutMap(mesh)
    layout_map["wte.weight"] = Layout(["model", U], mesh)  # a key for one of its paths
    layout_map.apply(model)
    assert model.lm_head.weight is model.wte.weight
    assert isinstance(model.wte.weight, DTensor)
    assert dtensor.fetch_layout(model.lm_head.weight).sharding_specs == ["model", U]
    assert len(list(model.parameters())) == 1


def test_tied_paths_with_different_layouts_are_an_error_naming_both(mesh):
    model = TiedModel()
    layout_map = LayoutMap(mesh)
    layout_map["wte.weight"] = Layout(["model", U], mesh)
    layout_map["lm_head.weight"] = Layout([U, "model"], mesh)
    with pytest.raises(LayoutError, match=r"reached by the paths \['wte.weight', 'lm_head.weight'"):
        layout_map.apply(model)
    assert not isinstance(model.wte.weight, DTensor)  # unchanged
