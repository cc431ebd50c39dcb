"""mgpu_lab.data.datasets: the synthetic data set, and archives of it that round-trip with their MD5."""
from __future__ import annotations

import hashlib

import pytest
import torch

from mgpu_lab.data import datasets


def test_synthetic_classification_is_deterministic_and_well_formed():
    a, b = datasets.synthetic_classification(90, seed=4), datasets.synthetic_classification(90, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    x, y = a.tensors
    assert x.shape == (90, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.bincount(y).tolist() == [30, 30, 30]
    other = datasets.synthetic_classification(90, seed=5)
    assert not torch.equal(other.tensors[0], x)


def test_same_task_different_seed_shares_the_class_centres():
    # Class means of two large samples of the same task agree; another task's do not.
    def means(ds):
        x, y = ds.tensors
        return torch.stack([x[y == c].mean(0) for c in range(3)])

    one, two = (datasets.synthetic_classification(3000, seed=s, noise=0.5) for s in (0, 1))
    other = datasets.synthetic_classification(3000, seed=0, noise=0.5, task=1)
    assert (means(one) - means(two)).abs().max() < 0.1
    assert (means(one) - means(other)).abs().max() > 0.3


@pytest.mark.parametrize("kwargs,name", [({"n": 0}, "n=0"), ({"n": 5, "classes": 0}, "classes=0")])
def test_synthetic_classification_rejects_empty_shapes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        datasets.synthetic_classification(**kwargs)


def test_archives_are_reproducible_and_round_trip(tmp_path):
    ds = datasets.synthetic_classification(40)
    md5 = datasets.write_archive(ds, tmp_path / "a" / "blobs.tar.gz")
    assert md5 == datasets.write_archive(ds, tmp_path / "b" / "blobs.tar.gz")
    assert md5 == hashlib.md5((tmp_path / "a" / "blobs.tar.gz").read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=r"must end with \.tar\.gz"):
        datasets.write_archive(ds, tmp_path / "blobs.zip")
    with pytest.raises(FileNotFoundError, match="tensors.pt does not exist"):
        datasets.load_archive_dir(tmp_path / "nowhere")
