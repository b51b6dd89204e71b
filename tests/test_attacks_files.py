"""Attacks from files (issue 14): a crafted sharded checkpoint, a crafted saved model, a
path-escaping index. Each payload, were it run, would create a marker file; each test asserts
that the marker does not exist and that the load was refused with a named error. The crafted
saves come with a matching manifest, as an attacker who can write the files can recompute it:
what refuses them is the loader's own check, not the checksum."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem import dtensor
from stratagem.dtensor import Layout, LayoutMap
from stratagem.keras.exported_program import ProgramError
from stratagem.train import UnsafeCheckpointError
from stratagem.train.manifest import write_manifest

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")


class _Payload:
    """Unpickling this creates the marker file: the harmless stand-in for running code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    mesh = dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    yield mesh
    dist.destroy_process_group()


def _sharded_checkpoint(mesh, directory):
    layout_map = LayoutMap(mesh)
    layout_map["weight"] = Layout.inner_sharded(mesh, "batch", rank=2)
    model = dtensor.apply_layout_map(torch.nn.Linear(4, 2), layout_map)
    checkpoint = sg.train.Checkpoint(model=model, epoch=torch.tensor(3))
    return checkpoint, checkpoint.save(os.path.join(directory, "ckpt"))


def _rewrite_manifest(path: str) -> None:
    write_manifest(path, [n for n in os.listdir(path) if n != "manifest.json"])


def test_a_pickled_dcp_metadata_is_refused_before_anything_runs(mesh, tmp_path):
    checkpoint, path = _sharded_checkpoint(mesh, tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    _rewrite_manifest(path)
    with pytest.raises(UnsafeCheckpointError, match=r"global io\.open"):
        checkpoint.restore(path)
    assert not marker.exists()


def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused(mesh, tmp_path):
    checkpoint, path = _sharded_checkpoint(mesh, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shards = [n for n in os.listdir(path) if n.endswith(".distcp")]
    os.rename(os.path.join(path, shards[0]), tmp_path / "elsewhere" / shards[0])
    metadata = torch.distributed.checkpoint.FileSystemReader(path).read_metadata()  # ours: trusted
    for info in metadata.storage_data.values():
        info.relative_path = f"../elsewhere/{info.relative_path}"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_manifest(path)
    with pytest.raises(UnsafeCheckpointError, match=r"not a file of the checkpoint directory"):
        checkpoint.restore(path)


def test_a_pickled_value_in_a_dcp_shard_is_refused(mesh, tmp_path):
    """DCP's own planner loads non-tensor values with torch.load(weights_only=False)."""
    from stratagem.train.dcp_reader import SafeLoadPlanner

    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_Payload(str(marker)), buffer)
    buffer.seek(0)
    planner = SafeLoadPlanner()
    planner.set_up_planner({"x": 1}, metadata=None, is_coordinator=True)
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "x"})()})()
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        planner.load_bytes(item, buffer)
    assert not marker.exists()


def _program_with_a_pickled_weight(save_dir: str, marker: str) -> None:
    program = os.path.join(save_dir, "program.pt2")
    with zipfile.ZipFile(program) as archive:
        entries = {n: archive.read(n) for n in archive.namelist()}
    for name, content in list(entries.items()):
        if name.endswith("model_weights_config.json"):
            config = json.loads(content)
            for payload in config["config"].values():
                payload["use_pickle"] = True
            entries[name] = json.dumps(config).encode()
        elif "/data/weights/weight_" in name:
            entries[name] = pickle.dumps(_Payload(marker))
    with zipfile.ZipFile(program, "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    _rewrite_manifest(save_dir)


def test_a_saved_model_whose_weight_is_pickled_is_refused(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = str(tmp_path / "saved")
    sg.saved_model.save(module, path, signatures=torch.ones(2, 3))
    marker = tmp_path / "ran"
    _program_with_a_pickled_weight(path, str(marker))
    with pytest.raises(ProgramError, match="pickled; refusing"):
        sg.keras.models.load_model(path)
    with pytest.raises(ProgramError, match="pickled; refusing"):
        sg.saved_model.load(path)
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["../other/ckpt-1", "/absolute/ckpt-1"])
def test_an_index_naming_a_path_outside_its_directory_is_refused(tmp_path, entry):
    other = tmp_path / "other"
    sg.train.Checkpoint(a=torch.tensor(1.0)).write(other / "ckpt-1")
    if entry.startswith("/"):
        entry = str(other / "ckpt-1")
    directory = tmp_path / "ckpts"
    sg.train.Checkpoint(a=torch.tensor(2.0)).save(directory / "ckpt")
    index = json.loads((directory / "checkpoint").read_text())
    index["latest"] = entry
    index["checkpoints"].append({"name": entry, "time": 0.0})
    (directory / "checkpoint").write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match="refusing to follow it"):
        sg.train.latest_checkpoint(directory)
    with pytest.raises(UnsafeCheckpointError, match="refusing to follow it"):
        sg.train.CheckpointManager(sg.train.Checkpoint(a=torch.tensor(0.0)), directory)
