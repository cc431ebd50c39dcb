"""Images stored encoded in memory: a dataset whose samples cost real CPU time.

A real image data set lives on disk as JPEG or PNG files; every sample the
model sees is read, *decoded* and *augmented* on the CPU. :class:`EncodedImages`
keeps that cost without needing a download: it draws small synthetic pictures
(a circle, a square or a triangle on a noisy background, the label says which),
encodes them once to JPEG/PNG bytes held in memory, and decodes and augments
one of them with torchvision transforms on every ``__getitem__`` — a couple of
milliseconds per sample, as with real photos.

Example:
    >>> ds = EncodedImages(n=64)
    >>> x, y = ds[0]
    >>> tuple(x.shape), CLASSES[y]
    ((3, 64, 64), 'circle')
"""
from __future__ import annotations

import io
import time
from functools import lru_cache

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

__all__ = ["CLASSES", "EncodedImages", "synth_image", "encode", "train_transform", "eval_transform",
           "decode_cost"]

CLASSES = ("circle", "square", "triangle")
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
FORMATS = ("JPEG", "PNG")


def synth_image(index: int, size: int = 128, seed: int = 0) -> Image.Image:
    """Picture ``index``: one shape (class ``index % 3``) on a smooth noisy background.

    The same ``(index, size, seed)`` always gives the same picture, whatever else
    was generated before (each picture has its own NumPy generator).

    Example:
        >>> synth_image(4, size=32).size
        (32, 32)
    """
    rng = np.random.default_rng([seed, index])
    blobs = (rng.random((8, 8, 3)) * 255).astype(np.uint8)
    background = Image.fromarray(blobs).resize((size, size), Image.BICUBIC)
    noise = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    img = Image.blend(background, noise, 0.3)
    draw = ImageDraw.Draw(img)
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    r = int(rng.integers(size // 6, size // 3))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    kind = index % len(CLASSES)
    if kind == 0:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif kind == 1:
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return img


def encode(img: Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    """The bytes of ``img`` saved as ``fmt`` ("JPEG" or "PNG"), as a file on disk would hold them."""
    out = io.BytesIO()
    img.save(out, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return out.getvalue()


@lru_cache(maxsize=8)
def _encoded(n: int, size: int, fmt: str, quality: int, seed: int) -> tuple[bytes, ...]:
    # Cached: a notebook builds the same data set several times (and forked
    # DataLoader workers inherit it without copying).
    return tuple(encode(synth_image(i, size, seed), fmt, quality) for i in range(n))


def train_transform(crop: int = 64):
    """Decode-time augmentation for training: random resized crop, flip, colour jitter, normalise."""
    from torchvision.transforms import v2 as T

    return T.Compose([
        T.RandomResizedCrop(crop, scale=(0.35, 1.0), antialias=True),
        T.RandomHorizontalFlip(),
        T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4),
        T.PILToTensor(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(MEAN, STD),
    ])


def eval_transform(crop: int = 64):
    """Deterministic transform for evaluation: resize, centre crop, normalise."""
    from torchvision.transforms import v2 as T

    return T.Compose([
        T.Resize(crop, antialias=True),
        T.CenterCrop(crop),
        T.PILToTensor(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(MEAN, STD),
    ])


class EncodedImages(Dataset):
    """``n`` synthetic images held as encoded bytes; decoded and augmented per sample.

    Args:
        n: number of images.
        size: side of the stored images in pixels.
        fmt: "JPEG" (smaller, slower to decode per byte) or "PNG".
        train: random augmentation (:func:`train_transform`) when True,
            the deterministic :func:`eval_transform` when False.
        crop: side of the tensors ``__getitem__`` returns.
        transform: a transform of the decoded PIL image that replaces the default.
        seed: which pictures (the same seed gives the same bytes).
        quality: JPEG quality.

    Raises:
        ValueError: n < 1, size < 16, an unknown format, or crop > size.

    Example:
        >>> ds = EncodedImages(n=30, size=64, crop=32, train=False)
        >>> len(ds), ds[1][0].shape, ds[1][1]
        (30, torch.Size([3, 32, 32]), 1)
    """

    def __init__(self, n: int = 1024, size: int = 128, fmt: str = "JPEG", train: bool = True,
                 crop: int = 64, transform=None, seed: int = 0, quality: int = 90):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: the data set needs at least one image, e.g. n=1024")
        if size < 16:
            raise ValueError(f"size={size}: images smaller than 16 pixels cannot show a shape; use size>=16")
        if fmt.upper() not in FORMATS:
            raise ValueError(f"fmt={fmt!r}: choose one of {', '.join(FORMATS)}")
        if crop > size:
            raise ValueError(f"crop={crop} is larger than the stored images (size={size}); use crop<={size}")
        self.n, self.size, self.fmt, self.crop, self.seed = n, size, fmt.upper(), crop, seed
        self.blobs = _encoded(n, size, self.fmt, quality, seed)
        self.labels = [i % len(CLASSES) for i in range(n)]
        self.transform = transform if transform is not None else (
            train_transform(crop) if train else eval_transform(crop))

    def __len__(self) -> int:
        return self.n

    def decode(self, index: int) -> Image.Image:
        """The stored picture ``index``, decoded (no augmentation)."""
        return Image.open(io.BytesIO(self.blobs[index])).convert("RGB")

    def __getitem__(self, index: int):
        return self.transform(self.decode(index)), self.labels[index]

    @property
    def nbytes(self) -> int:
        """Bytes of encoded images held in memory."""
        return sum(len(b) for b in self.blobs)

    def __repr__(self) -> str:
        return (f"EncodedImages(n={self.n}, {self.size}x{self.size} {self.fmt}, "
                f"{self.nbytes / 2**20:.1f} MiB encoded, samples {self.crop}x{self.crop})")


def decode_cost(dataset: Dataset, samples: int = 100) -> float:
    """Mean seconds per ``dataset[i]`` in this process, over the first ``samples`` items.

    Example:
        >>> decode_cost(EncodedImages(n=8), samples=8) > 0
        True
    """
    samples = min(samples, len(dataset))
    if samples < 1:
        raise ValueError(f"samples={samples}: measure at least one sample (the data set has {len(dataset)})")
    dataset[0]  # the first call pays one-off costs (lazy imports, caches)
    start = time.perf_counter()
    for i in range(samples):
        dataset[i]
    return (time.perf_counter() - start) / samples
