"""Data sets the lessons use, and archives of them with checksums.

There is no internet on the course machines, so the lessons make their data:
:func:`synthetic_classification` is a small deterministic classification set
(the same tensors on every rank and every machine for a given seed).
:func:`write_archive` packs a data set into a reproducible ``.tar.gz`` (same
data, same MD5) and :func:`load_archive_dir` loads it once extracted; serving
and downloading such archives, once per node, is :mod:`mgpu_lab.data.download`.

Example:
    >>> ds = synthetic_classification(100, features=8, classes=3, seed=0)
    >>> len(ds), ds[0][0].shape, ds.tensors[1].max().item()
    (100, torch.Size([8]), 2)
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

__all__ = ["synthetic_classification", "md5sum", "write_archive", "load_archive_dir"]


def synthetic_classification(n: int, features: int = 8, classes: int = 3, seed: int = 0,
                             noise: float = 1.0, task: int = 0) -> TensorDataset:
    """A deterministic, learnable classification set: Gaussian blobs around class centres.

    ``task`` fixes the class centres (the problem); ``seed`` picks the samples.
    Two calls with the same task and different seeds are a training set and a
    fresh validation set from the same distribution.

    Args:
        n: number of samples (>= 1).
        features: length of each input vector.
        classes: number of classes (labels 0..classes-1, nearly balanced).
        seed: which samples; the same seed gives bit-identical tensors everywhere.
        noise: standard deviation around each centre; larger is harder.
        task: which class centres.

    Returns:
        A ``TensorDataset`` of ``x`` (float32, ``[n, features]``) and ``y`` (int64, ``[n]``).

    Raises:
        ValueError: ``n``, ``features`` or ``classes`` below 1.

    Example:
        >>> train = synthetic_classification(512, seed=0)
        >>> val = synthetic_classification(100, seed=1)    # same centres, new samples
        >>> train[0][0].dtype, train[0][1].dtype
        (torch.float32, torch.int64)
    """
    for name, value in (("n", n), ("features", features), ("classes", classes)):
        if value < 1:
            raise ValueError(f"synthetic_classification: {name}={value} must be >= 1")
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(task))
    g = torch.Generator().manual_seed(1_000_003 * (task + 1) + seed)
    y = torch.arange(n) % classes
    y = y[torch.randperm(n, generator=g)]
    x = centres[y] + noise * torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


def md5sum(path: str | os.PathLike) -> str:
    """The MD5 hex digest of a file (what torchvision's ``md5=`` arguments expect).

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "hello.txt"
        >>> _ = path.write_bytes(b"hello")
        >>> md5sum(path)
        '5d41402abc4b2a76b9719d911017c592'
    """
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_archive(dataset: TensorDataset, path: str | os.PathLike) -> str:
    """Pack a ``TensorDataset`` into ``path``, a ``.tar.gz`` holding ``<stem>/tensors.pt``.

    ``<stem>`` is the archive's name without ``.tar.gz``, the directory
    :func:`mgpu_lab.data.download.fetch_archive` returns after extracting it.

    The archive is reproducible (fixed member time), so the same data give the
    same MD5. Returns the archive's MD5.

    Example:
        >>> import tempfile
        >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> ds = synthetic_classification(50)
        >>> write_archive(ds, f"{a}/blobs.tar.gz") == write_archive(ds, f"{b}/blobs.tar.gz")   # the same MD5
        True
    """
    buf = io.BytesIO()
    torch.save({"tensors": list(dataset.tensors)}, buf)
    payload = buf.getvalue()
    if not str(path).endswith(".tar.gz"):
        raise ValueError(f"write_archive: path={os.fspath(path)!r} must end with .tar.gz")
    stem = Path(path).name.removesuffix(".tar.gz")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo(f"{stem}/tensors.pt")
        info.size, info.mtime, info.mode = len(payload), 0, 0o644
        tar.addfile(info, io.BytesIO(payload))
    return md5sum(path)


def load_archive_dir(directory: str | os.PathLike) -> TensorDataset:
    """Load the ``TensorDataset`` that :func:`write_archive` packed, once extracted.

    Raises:
        FileNotFoundError: ``directory/tensors.pt`` is missing (named in the message).
    """
    path = Path(directory) / "tensors.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; extract the archive first (fetch_archive does)")
    return TensorDataset(*torch.load(path, weights_only=True)["tensors"])
