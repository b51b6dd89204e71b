"""sg.data.datasets: the bundled digits in MNIST's layout, and reading a local mnist.npz."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits as sklearn_digits

from stratagem.data import datasets
from stratagem.errors import InputError


@pytest.fixture(scope="module")
def digits():
    return datasets.load_digits()


def test_digits_have_mnist_layout_dtypes_and_range(digits):
    (x_train, y_train), (x_test, y_test) = digits
    assert x_train.shape == (1437, 28, 28) and x_test.shape == (360, 28, 28)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.int64
    assert x_train.min() == 0 and x_train.max() == 255
    assert set(np.unique(y_train)) == set(range(10))
    scaled = x_train / np.float32(255)  # the seed tutorial's line, unchanged
    assert scaled.dtype == np.float32 and 0.0 <= scaled.min() <= scaled.max() <= 1.0


def test_split_is_stratified_and_covers_every_image_once(digits):
    (_, y_train), (_, y_test) = digits
    everything = sklearn_digits().target
    counts = np.bincount(everything)
    assert (np.bincount(y_train) + np.bincount(y_test) == counts).all()
    assert (np.bincount(y_test) > 0).all() and (np.bincount(y_train) > 0).all()
    # stratified: each digit's test share is within one image of 20%
    assert (np.abs(np.bincount(y_test) - counts * 0.2) <= 1).all()


def test_split_is_deterministic_per_seed(digits):
    (x_train, y_train), _ = digits
    (x_again, y_again), _ = datasets.load_digits()
    assert (x_again == x_train).all() and (y_again == y_train).all()
    (x_other, _), _ = datasets.load_digits(seed=1)
    assert not (x_other == x_train).all()


def test_native_size_keeps_the_original_pixels():
    (x_train, _), (x_test, _) = datasets.load_digits(image_size=8, test_fraction=0.5)
    assert x_train.shape[1:] == (8, 8) and len(x_train) + len(x_test) == 1797
    original = {
        img.tobytes() for img in np.round(sklearn_digits().images * 255 / 16).astype(np.uint8)
    }
    assert {img.tobytes() for img in x_test} <= original


def test_upsampling_is_bilinear_and_bounded():
    (x_small, _), _ = datasets.load_digits(image_size=16)
    assert x_small.shape[1:] == (16, 16) and x_small.dtype == np.uint8
    # interpolation makes intermediate shades the 17 source levels do not have
    assert len(np.unique(x_small)) > 17


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_size": 0}, "image_size must be a positive integer; got 0"),
        ({"image_size": 2.5}, r"got 2\.5"),
        ({"test_fraction": 0.0}, "strictly between 0 and 1; got 0.0"),
        ({"test_fraction": 1}, "got 1"),
        ({"test_fraction": 0.001}, "needs at least 10"),
    ],
)
def test_load_digits_rejects_bad_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        datasets.load_digits(**kwargs)


def write_mnist(path, **overrides):
    arrays = {
        "x_train": np.zeros((6, 28, 28), dtype=np.uint8),
        "y_train": np.arange(6, dtype=np.uint8),
        "x_test": np.full((2, 28, 28), 255, dtype=np.uint8),
        "y_test": np.array([7, 9], dtype=np.uint8),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_load_mnist_reads_a_local_keras_npz(tmp_path):
    path = write_mnist(tmp_path / "mnist.npz")
    (x_train, y_train), (x_test, y_test) = datasets.load_mnist(path)
    assert x_train.shape == (6, 28, 28) and x_train.dtype == np.uint8
    assert y_train.tolist() == list(range(6)) and y_test.tolist() == [7, 9]
    assert x_test.max() == 255
    assert datasets.load_mnist(str(path))[0][0].shape == (6, 28, 28)


def test_load_mnist_never_downloads_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no file at .*never downloads data"):
        datasets.load_mnist(tmp_path / "absent.npz")
    with pytest.raises(FileNotFoundError, match="a directory"):
        datasets.load_mnist(tmp_path)


def test_load_mnist_lists_missing_and_found_keys(tmp_path):
    path = write_mnist(tmp_path / "partial.npz", y_test=None, extra=np.zeros(1))
    with pytest.raises(InputError, match=r"\['y_test'\].*holds \['extra', 'x_test'"):
        datasets.load_mnist(path)


def test_load_mnist_rejects_unreadable_or_inconsistent_files(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip archive")
    with pytest.raises(InputError, match="could not read"):
        datasets.load_mnist(junk)
    short = write_mnist(tmp_path / "short.npz", y_train=np.arange(5, dtype=np.uint8))
    with pytest.raises(InputError, match=r"x_train has shape \(6, 28, 28\) but y_train .*\(5,\)"):
        datasets.load_mnist(short)
