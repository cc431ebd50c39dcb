"""mgpu_lab.data.images: the encoded-image data set of lesson 02."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from mgpu_lab.data.images import CLASSES, EncodedImages, decode_cost, encode, synth_image


def test_pictures_are_deterministic_per_index():
    a, b = synth_image(5, size=32, seed=1), synth_image(5, size=32, seed=1)
    assert a.tobytes() == b.tobytes()
    assert synth_image(5, size=32, seed=2).tobytes() != a.tobytes()
    assert synth_image(6, size=32, seed=1).tobytes() != a.tobytes()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_encode_round_trips(fmt):
    img = synth_image(0, size=32)
    blob = encode(img, fmt)
    back = Image.open(io.BytesIO(blob))
    assert back.format == fmt and back.size == (32, 32)
    if fmt == "PNG":  # lossless
        assert back.convert("RGB").tobytes() == img.tobytes()


def test_dataset_holds_encoded_bytes_and_decodes_per_sample():
    ds = EncodedImages(n=12, size=48, crop=32)
    assert len(ds) == 12 and ds.nbytes == sum(len(b) for b in ds.blobs)
    assert all(blob[:2] == b"\xff\xd8" for blob in ds.blobs)  # JPEG files
    x, y = ds[4]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == 4 % len(CLASSES)
    assert "12" in repr(ds) and "JPEG" in repr(ds)


def test_training_samples_are_augmented_eval_samples_are_not():
    train = EncodedImages(n=4, size=48, crop=32)
    torch.manual_seed(0)
    a = train[1][0]
    torch.manual_seed(1)
    assert not torch.equal(a, train[1][0])
    evaluation = EncodedImages(n=4, size=48, crop=32, train=False)
    assert torch.equal(evaluation[1][0], evaluation[1][0])


def test_same_arguments_share_the_bytes():
    assert EncodedImages(n=5, size=32, crop=16).blobs is EncodedImages(n=5, size=32, crop=16).blobs


def test_custom_transform():
    ds = EncodedImages(n=3, size=32, crop=32, transform=lambda img: img.size)
    assert ds[0] == ((32, 32), 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "at least one image"), ({"size": 8}, "size>=16"), ({"fmt": "GIF"}, "JPEG, PNG"),
    ({"size": 32, "crop": 64}, "crop<=32")])
def test_bad_arguments_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncodedImages(**kwargs)


def test_decode_cost_is_measured():
    assert decode_cost(EncodedImages(n=6, size=32, crop=16), samples=6) > 0
    with pytest.raises(ValueError, match="at least one sample"):
        decode_cost(EncodedImages(n=2, size=32, crop=16), samples=0)
