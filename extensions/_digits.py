"""The digits data set shipped with gpulab, for examples and tests that must not download.

``data/digits.npz`` is scikit-learn's ``load_digits()`` (1,797 8x8 grey images, pixel values
0-16, ten classes; originally the UCI "Optical Recognition of Handwritten Digits" test set),
saved once as uint8 with ``numpy.savez_compressed`` (arrays ``images`` (1797, 64) and
``labels`` (1797,)), so the notebook and training images need neither scikit-learn nor a
network. Only numpy is needed, and only when the data is loaded.
"""

from __future__ import annotations

from importlib import resources

N_SAMPLES = 1797
N_FEATURES = 64
N_CLASSES = 10
MAX_PIXEL = 16


def load_digits_arrays():
    """The raw arrays: ``(images uint8 (1797, 64), labels uint8 (1797,))``."""
    import numpy as np

    ref = resources.files(__package__).joinpath("data", "digits.npz")
    try:
        with ref.open("rb") as f, np.load(f) as npz:
            images, labels = npz["images"], npz["labels"]
    except FileNotFoundError as e:
        raise RuntimeError(
            "gpulab's digits data (gpulab/extensions/data/digits.npz) is not installed; "
            "the package was built without its package data"
        ) from e
    if images.shape != (N_SAMPLES, N_FEATURES) or labels.shape != (N_SAMPLES,):
        raise RuntimeError(f"digits.npz has unexpected shapes {images.shape}, {labels.shape}")
    return images, labels


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """Deterministic, stratified train/test split of the digits.

    Returns ``(x_train, y_train), (x_test, y_test)``: x float32 in [0, 1] of shape (n, 64), y
    int32 class labels 0-9. Each class contributes ``round(test_fraction * its count)`` samples
    to the test split, chosen by a permutation from ``numpy.random.default_rng(seed)``; the
    same arguments give the same split on every machine (360 test samples for the default
    0.2). Rows within each split are in a seeded random order.
    """
    import numpy as np

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be between 0 and 1, not {test_fraction!r}")
    images, labels = load_digits_arrays()
    rng = np.random.default_rng(seed)
    test_idx, train_idx = [], []
    for cls in range(N_CLASSES):
        idx = np.flatnonzero(labels == cls)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(test_fraction * len(idx)))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train = np.concatenate(train_idx)
    test = np.concatenate(test_idx)
    train = train[rng.permutation(len(train))]
    test = test[rng.permutation(len(test))]
    x = images.astype(np.float32) / MAX_PIXEL
    y = labels.astype(np.int32)
    return (x[train], y[train]), (x[test], y[test])
