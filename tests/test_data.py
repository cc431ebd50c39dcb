"""mgpu_lab.data: the synthetic data set, archives over a local HTTP server, download_once in real ranks."""
from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import data, launch
from mgpu_lab.launcher.launch import LaunchError

pytestmark = pytest.mark.timeout(180)


def test_synthetic_classification_is_deterministic_and_well_formed():
    a, b = data.synthetic_classification(90, seed=4), data.synthetic_classification(90, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    x, y = a.tensors
    assert x.shape == (90, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.bincount(y).tolist() == [30, 30, 30]
    other = data.synthetic_classification(90, seed=5)
    assert not torch.equal(other.tensors[0], x)


def test_same_task_different_seed_shares_the_class_centres():
    # Class means of two large samples of the same task agree; another task's do not.
    def means(ds):
        x, y = ds.tensors
        return torch.stack([x[y == c].mean(0) for c in range(3)])

    one, two = (data.synthetic_classification(3000, seed=s, noise=0.5) for s in (0, 1))
    other = data.synthetic_classification(3000, seed=0, noise=0.5, task=1)
    assert (means(one) - means(two)).abs().max() < 0.1
    assert (means(one) - means(other)).abs().max() > 0.3


@pytest.mark.parametrize("kwargs,name", [({"n": 0}, "n=0"), ({"n": 5, "classes": 0}, "classes=0")])
def test_synthetic_classification_rejects_empty_shapes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        data.synthetic_classification(**kwargs)


def test_archives_are_reproducible_and_round_trip(tmp_path):
    ds = data.synthetic_classification(40)
    md5 = data.write_archive(ds, tmp_path / "a" / "blobs.tar.gz")
    assert md5 == data.write_archive(ds, tmp_path / "b" / "blobs.tar.gz")
    assert md5 == hashlib.md5((tmp_path / "a" / "blobs.tar.gz").read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=r"must end with \.tar\.gz"):
        data.write_archive(ds, tmp_path / "blobs.zip")
    with pytest.raises(FileNotFoundError, match="tensors.pt does not exist"):
        data.load_archive_dir(tmp_path / "nowhere")


def test_fetch_archive_downloads_once_verifies_and_leaves_no_temporary_files(tmp_path):
    ds = data.synthetic_classification(40)
    md5 = data.write_archive(ds, tmp_path / "served" / "blobs.tar.gz")
    root = tmp_path / "root"
    with data.serve(tmp_path / "served") as server:
        first = data.fetch_archive(server.url + "blobs.tar.gz", root, md5)
        second = data.fetch_archive(server.url + "blobs.tar.gz", root, md5)
        assert server.downloads["blobs.tar.gz"] == 1  # the second call found the verified file
        with pytest.raises(RuntimeError, match=r"expected md5='0{32}'"):
            data.fetch_archive(server.url + "blobs.tar.gz", tmp_path / "bad", "0" * 32)
    assert first == second == os.fspath(root / "blobs")
    loaded = data.load_archive_dir(first)
    assert all(torch.equal(x, y) for x, y in zip(loaded.tensors, ds.tensors))
    assert sorted(os.listdir(root)) == ["blobs", "blobs.tar.gz"]
    assert os.listdir(tmp_path / "bad") == []  # the corrupt download was removed


def test_serve_shuts_down_and_counts_queries_apart(tmp_path):
    (tmp_path / "f.txt").write_text("hello")
    with data.serve(tmp_path, delay=0.01) as server:
        assert urllib.request.urlopen(server.url + "f.txt?node=1").read() == b"hello"
        url = server.url
    assert server.downloads == {"f.txt?node=1": 1}
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "f.txt", timeout=2)


def test_download_once_without_a_process_group_just_calls(tmp_path):
    calls = []
    wrapped = data.download_once(lambda root: calls.append(root) or f"{root}/x")
    assert wrapped("r") == "r/x" and calls == ["r"]
    assert wrapped.__wrapped__ is not None


# -- in real ranks --------------------------------------------------------------------
def _fetch_on_nodes(url, md5, roots, once):
    import torchvision.datasets.utils  # noqa: F401  (imported before the race, not during it)

    node = data.simulate_nodes(2)
    dist.barrier()  # every rank starts fetching at the same moment
    get = data.download_once(data.fetch_archive) if once else data.fetch_archive
    path = get(f"{url}?node={node}", roots[node], md5)
    return node, path, len(data.load_archive_dir(path))


def test_download_once_fetches_once_per_simulated_node(tmp_path):
    md5 = data.write_archive(data.synthetic_classification(64), tmp_path / "served" / "blobs.tar.gz")
    roots = [os.fspath(tmp_path / f"node{i}") for i in range(2)]
    with data.serve(tmp_path / "served", delay=0.3) as server:
        results = launch(_fetch_on_nodes, 4, server.url + "blobs.tar.gz", md5, roots, True, timeout=90)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert [r[1] for r in results] == [os.path.join(roots[n], "blobs") for n in (0, 0, 1, 1)]
    assert all(r[2] == 64 for r in results)
    assert dict(server.downloads) == {"blobs.tar.gz?node=0": 1, "blobs.tar.gz?node=1": 1}


def test_without_download_once_every_rank_downloads_but_files_stay_whole(tmp_path):
    md5 = data.write_archive(data.synthetic_classification(64), tmp_path / "served" / "blobs.tar.gz")
    roots = [os.fspath(tmp_path / f"node{i}") for i in range(2)]
    with data.serve(tmp_path / "served", delay=1.0) as server:
        results = launch(_fetch_on_nodes, 4, server.url + "blobs.tar.gz", md5, roots, False, timeout=90)
    assert all(r[2] == 64 for r in results)  # temporary names + rename: concurrent fetches stay safe
    assert sum(server.downloads.values()) == 4


def _leader_fails():
    data.simulate_nodes(1)

    @data.download_once
    def fetch(root):
        raise OSError(f"disk full under {root}")

    return fetch("/data")


def test_download_once_raises_the_leaders_error_on_every_rank():
    with pytest.raises(LaunchError) as info:
        launch(_leader_fails, 2, timeout=60)
    assert "fetch failed on node 0: OSError: disk full under /data" in str(info.value)


def _layout(ranks_per_node):
    node = data.simulate_nodes(ranks_per_node)
    return node, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]


def test_simulate_nodes_sets_the_torchrun_variables():
    assert launch(_layout, 4, 2) == [(0, "0", "2", "0"), (0, "1", "2", "0"), (1, "0", "2", "1"), (1, "1", "2", "1")]
    with pytest.raises(LaunchError, match=r"world_size=3 is not a multiple of ranks_per_node=2"):
        launch(_layout, 3, 2)
    assert dist.is_available()
