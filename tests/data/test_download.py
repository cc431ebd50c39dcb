"""mgpu_lab.data.download: archives over a local HTTP server; mgpu_lab.data.per_node.run_once in real ranks."""
from __future__ import annotations

import importlib
import os
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.data import datasets, download, per_node
from mgpu_lab.launcher.launch import LaunchError

pytestmark = pytest.mark.timeout(180)


def test_fetch_archive_downloads_once_verifies_and_leaves_no_temporary_files(tmp_path):
    ds = datasets.synthetic_classification(40)
    md5 = datasets.write_archive(ds, tmp_path / "served" / "blobs.tar.gz")
    root = tmp_path / "root"
    with download.serve(tmp_path / "served") as server:
        first = download.fetch_archive(server.url + "blobs.tar.gz", root, md5)
        second = download.fetch_archive(server.url + "blobs.tar.gz", root, md5)
        assert server.downloads["blobs.tar.gz"] == 1  # the second call found the verified file
        with pytest.raises(RuntimeError, match=r"expected md5='0{32}'"):
            download.fetch_archive(server.url + "blobs.tar.gz", tmp_path / "bad", "0" * 32)
    assert first == second == os.fspath(root / "blobs")
    loaded = datasets.load_archive_dir(first)
    assert all(torch.equal(x, y) for x, y in zip(loaded.tensors, ds.tensors))
    assert sorted(os.listdir(root)) == ["blobs", "blobs.tar.gz"]
    assert os.listdir(tmp_path / "bad") == []  # the corrupt download was removed


def test_fetch_archive_writes_through_a_private_temporary_file_never_a_planted_symlink(tmp_path, monkeypatch):
    import stat

    from torchvision.datasets import utils as tv_utils

    md5 = datasets.write_archive(datasets.synthetic_classification(40), tmp_path / "served" / "blobs.tar.gz")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    roots = [tmp_path / "root", tmp_path / "other"]
    planted = [f"blobs.tar.gz.part-{os.getpid()}", "blobs.tar.gz.part", "blobs.tar.gz.tmp", ".blobs.tar.gz.part"]
    for root in roots:
        root.mkdir()
        for name in planted:  # names another local user could predict and plant
            (root / name).symlink_to(victim)
    given, real = [], tv_utils.download_url

    def spy(url, root, filename=None, md5=None, **kwargs):
        st = os.lstat(os.path.join(root, filename))  # what torchvision is about to write into
        given.append((os.path.dirname(os.path.join(root, filename)), filename, stat.S_ISREG(st.st_mode),
                      stat.S_IMODE(st.st_mode), st.st_size))
        return real(url, root, filename, md5, **kwargs)

    monkeypatch.setattr(tv_utils, "download_url", spy)
    umask = os.umask(0o022)
    os.umask(umask)
    with download.serve(tmp_path / "served") as server:
        paths = [download.fetch_archive(server.url + "blobs.tar.gz", root, md5) for root in roots]
    assert victim.read_bytes() == b"precious", "the download was written through a planted symlink"
    assert [len(datasets.load_archive_dir(p)) for p in paths] == [40, 40]
    for (where, name, regular, mode, size), root in zip(given, roots):
        # made beforehand by mkstemp in the same directory: a new, empty, private regular file
        assert where == str(root) and name not in planted and regular and mode == 0o600 and size == 0
    assert given[0][1] != given[1][1]  # a random name, not one derived from the file or the pid
    for root in roots:
        assert all((root / name).is_symlink() for name in planted)  # others' files are left alone
        assert sorted(os.listdir(root)) == sorted(["blobs", "blobs.tar.gz", *planted])
        assert stat.S_IMODE(os.stat(root / "blobs.tar.gz").st_mode) == 0o666 & ~umask


def test_serve_shuts_down_and_counts_queries_apart(tmp_path):
    (tmp_path / "f.txt").write_text("hello")
    with download.serve(tmp_path, delay=0.01) as server:
        assert urllib.request.urlopen(server.url + "f.txt?node=1").read() == b"hello"
        url = server.url
    assert server.downloads == {"f.txt?node=1": 1}
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "f.txt", timeout=2)


def test_run_once_without_a_process_group_just_calls(tmp_path):
    calls = []
    wrapped = per_node.run_once(lambda root: calls.append(root) or f"{root}/x")
    assert wrapped("r") == "r/x" and calls == ["r"]
    assert wrapped.__wrapped__ is not None


# -- in real ranks --------------------------------------------------------------------
def _fetch_on_nodes(url, md5, roots, once):
    importlib.import_module("torchvision.datasets.utils")  # imported before the race, not during it

    node = download.simulate_nodes(2)
    dist.barrier()  # every rank starts fetching at the same moment
    get = per_node.run_once(download.fetch_archive) if once else download.fetch_archive
    path = get(f"{url}?node={node}", roots[node], md5)
    return node, path, len(datasets.load_archive_dir(path))


def test_run_once_fetches_once_per_simulated_node(tmp_path):
    md5 = datasets.write_archive(datasets.synthetic_classification(64), tmp_path / "served" / "blobs.tar.gz")
    roots = [os.fspath(tmp_path / f"node{i}") for i in range(2)]
    with download.serve(tmp_path / "served", delay=0.3) as server:
        results = launch(_fetch_on_nodes, 4, server.url + "blobs.tar.gz", md5, roots, True, timeout=90)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert [r[1] for r in results] == [os.path.join(roots[n], "blobs") for n in (0, 0, 1, 1)]
    assert all(r[2] == 64 for r in results)
    assert dict(server.downloads) == {"blobs.tar.gz?node=0": 1, "blobs.tar.gz?node=1": 1}


def test_without_run_once_every_rank_downloads_but_files_stay_whole(tmp_path):
    md5 = datasets.write_archive(datasets.synthetic_classification(64), tmp_path / "served" / "blobs.tar.gz")
    roots = [os.fspath(tmp_path / f"node{i}") for i in range(2)]
    with download.serve(tmp_path / "served", delay=1.0) as server:
        results = launch(_fetch_on_nodes, 4, server.url + "blobs.tar.gz", md5, roots, False, timeout=90)
    assert all(r[2] == 64 for r in results)  # temporary names + rename: concurrent fetches stay safe
    assert sum(server.downloads.values()) == 4


def _leader_fails():
    download.simulate_nodes(1)

    @per_node.run_once
    def fetch(root):
        raise OSError(f"disk full under {root}")

    return fetch("/data")


def test_run_once_raises_the_leaders_error_on_every_rank():
    with pytest.raises(LaunchError) as info:
        launch(_leader_fails, 2, timeout=60)
    assert "fetch failed on node 0: OSError: disk full under /data" in str(info.value)


def _layout(ranks_per_node):
    node = download.simulate_nodes(ranks_per_node)
    return node, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"]


def test_simulate_nodes_sets_the_torchrun_variables():
    assert launch(_layout, 4, 2) == [(0, "0", "2", "0"), (0, "1", "2", "0"), (1, "0", "2", "1"), (1, "1", "2", "1")]
    with pytest.raises(LaunchError, match=r"world_size=3 is not a multiple of ranks_per_node=2"):
        launch(_layout, 3, 2)
    assert dist.is_available()
