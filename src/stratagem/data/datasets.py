"""The data sets stratagem's examples and tests run on, with no download.

``load_digits`` is scikit-learn's bundled 8x8 digits, upsampled to MNIST's layout, so a
tutorial written for ``tf.keras.datasets.mnist.load_data()`` runs unchanged and offline.
``load_mnist`` reads a real ``mnist.npz`` the user already has.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

from stratagem.errors import InputError

Split = tuple[np.ndarray, np.ndarray]

_DIGITS_MAX = 16.0  # scikit-learn's digits are counts of 4x4 pixel blocks: 0..16
_MNIST_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_digits(
    image_size: int = 28, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Split, Split]:
    """scikit-learn's 1797 handwritten digits as ``((x_train, y_train), (x_test, y_test))``.

    Images are upsampled from 8x8 to ``image_size`` x ``image_size`` (bilinear) and scaled to
    0..255, returned as uint8 ``[N, H, W]`` like ``tf.keras.datasets.mnist.load_data()``, so
    ``x / np.float32(255)`` ports unchanged; labels are int64 in 0..9. The split is stratified
    (every digit in the same proportion on both sides) and the same for the same ``seed``; at
    0.2 it is 1437 train / 360 test images.
    """
    from sklearn.datasets import load_digits as sklearn_digits  # import cost only when used
    from sklearn.model_selection import train_test_split

    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise InputError(f"image_size must be a positive integer; got {image_size!r}")
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise InputError(f"test_fraction must be strictly between 0 and 1; got {test_fraction!r}")
    digits = sklearn_digits()
    images = np.asarray(digits.images, dtype=np.float32)
    labels = np.asarray(digits.target, dtype=np.int64)

    classes = len(np.unique(labels))
    n_test = math.ceil(test_fraction * len(labels))  # as scikit-learn rounds it
    if n_test < classes or len(labels) - n_test < classes:
        raise InputError(
            f"test_fraction={test_fraction} puts {n_test} of {len(labels)} images in the test "
            f"split; a stratified split needs at least {classes} (one per digit) on each side"
        )
    pixels = _upsample(images, image_size)
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, labels, test_size=n_test, stratify=labels, random_state=seed
    )
    return (x_train, y_train), (x_test, y_test)


def _upsample(images: np.ndarray, size: int) -> np.ndarray:
    """``[N, 8, 8]`` values in 0..16 to uint8 ``[N, size, size]`` in 0..255."""
    batch = torch.from_numpy(images).unsqueeze(1)
    if size != images.shape[-1]:
        batch = F.interpolate(batch, size=(size, size), mode="bilinear", align_corners=False)
    scaled = (batch.squeeze(1) * (255.0 / _DIGITS_MAX)).round().clamp(0, 255)
    return scaled.to(torch.uint8).numpy()


def load_mnist(path: str | os.PathLike[str]) -> tuple[Split, Split]:
    """``((x_train, y_train), (x_test, y_test))`` from a local Keras-format ``mnist.npz``.

    The same arrays, dtypes included, as ``tf.keras.datasets.mnist.load_data()`` returns from
    that file. stratagem never downloads: ``path`` must name a file you already have.
    """
    file = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(file):
        what = "a directory" if os.path.isdir(file) else "no file"
        raise FileNotFoundError(
            f"{what} at {file!r}; stratagem never downloads data: pass the path of a local "
            "mnist.npz (with arrays x_train, y_train, x_test, y_test)"
        )
    try:
        with np.load(file, allow_pickle=False) as archive:
            found = sorted(archive.files)
            missing = [key for key in _MNIST_KEYS if key not in found]
            if missing:
                raise InputError(
                    f"{file!r} lacks the array(s) {missing}; a Keras mnist.npz holds "
                    f"{list(_MNIST_KEYS)}, this file holds {found}"
                )
            arrays = {key: archive[key] for key in _MNIST_KEYS}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(f"could not read {file!r} as an .npz archive: {error}") from error
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
            raise InputError(
                f"{file!r}: x_{split} has shape {x.shape} but y_{split} has shape {y.shape}; "
                "expected one label per image"
            )
    return (arrays["x_train"], arrays["y_train"]), (arrays["x_test"], arrays["y_test"])
