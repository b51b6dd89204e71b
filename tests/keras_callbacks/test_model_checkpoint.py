"""sg.keras.callbacks.ModelCheckpoint: its saves are sg.train checkpoints load_weights reads
(with CSVLogger's rows, which the same test checks); save_best_only; a filepath naming a log
that is missing."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import build_model, keras_data


def test_model_checkpoint_csv_logger_and_load_weights(tmp_path):
    x, y = keras_data(48)
    model = _compiled()
    saver = sg.keras.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt" / "w-{epoch:02d}"), save_weights_only=True
    )
    logger = sg.keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    history = model.fit(x, y, batch_size=16, epochs=3, callbacks=[saver, logger], verbose=0)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["checkpoint", "w-01", "w-02", "w-03"]
    assert sg.train.latest_checkpoint(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "w-03")
    fresh = sg.keras.Model(build_model())
    fresh.load_weights(str(tmp_path / "ckpt"))  # a directory: its newest checkpoint
    for k, v in model.module.state_dict().items():
        torch.testing.assert_close(fresh.module.state_dict()[k], v, rtol=0, atol=0)
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,accuracy,loss" and len(rows) == 4, rows
    for epoch, row in enumerate(rows[1:]):
        e, accuracy, loss = row.split(",")
        assert int(e) == epoch
        assert float(loss) == pytest.approx(history.history["loss"][epoch], rel=1e-6)
        assert float(accuracy) == pytest.approx(history.history["accuracy"][epoch], rel=1e-6)


def test_model_checkpoint_save_best_only_and_a_filepath_naming_a_missing_log(tmp_path):
    x, y = keras_data(48)
    frozen = _compiled(lr=0.0)  # the loss never improves after the first epoch
    best = sg.keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best-{epoch}"), monitor="loss", save_best_only=True
    )
    frozen.fit(x, y, batch_size=16, epochs=3, shuffle=False, callbacks=[best], verbose=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-1", "checkpoint"]
    wrong = sg.keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{val_auc}"))
    with pytest.raises(KeyError, match="names 'val_auc'"):
        frozen.fit(x, y, batch_size=16, epochs=1, callbacks=[wrong], verbose=0)
