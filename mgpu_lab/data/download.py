"""Serving data archives locally, and downloading them once per node.

The real download code path runs without internet: :func:`serve` starts a
local HTTP server and :func:`fetch_archive` downloads through torchvision's
utilities with an MD5 check, to a temporary name that is renamed only once the
file is complete. :func:`simulate_nodes` lets the ranks of one machine play
several nodes; ``scripts/ddp_train.py`` makes one rank per node download. The archives are those of :func:`mgpu_lab.data.datasets.write_archive`.

Example:
    >>> import tempfile
    >>> from mgpu_lab.data import datasets
    >>> served, root = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> md5 = datasets.write_archive(datasets.synthetic_classification(50), f"{served}/blobs.tar.gz")
    >>> with serve(served) as server:   # in a job: one rank per node fetches, the others wait
    ...     path = fetch_archive(server.url + "blobs.tar.gz", root, md5)
    >>> os.path.relpath(path, root), sorted(os.listdir(path))
    ('blobs', ['tensors.pt'])
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from mgpu_lab import dist as mdist
from mgpu_lab.data.datasets import md5sum

__all__ = ["serve", "fetch_archive", "simulate_nodes"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_GET(self):  # noqa: N802 - http.server's naming
        # torchvision first follows redirects with a GET marked "Method: HEAD"
        # (it reads no body); count only the requests that download the file.
        if self.headers.get("Method") != "HEAD":
            self.server.downloads[self.path.lstrip("/")] += 1
            time.sleep(self.server.delay)  # a slow link: concurrent downloads really overlap
        super().do_GET()


class _NoBar:
    """Stands in for tqdm: even a disabled tqdm creates a multiprocessing lock, which a rank
    ending with os._exit leaves behind (a resource_tracker warning at shutdown)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass


@contextmanager
def serve(directory: str | os.PathLike, delay: float = 0.0):
    """Serve ``directory`` over HTTP on 127.0.0.1 (a free port) while the block runs.

    ``delay`` seconds pass before each download starts, as over a slow link.

    Yields the server; ``server.url`` is its base URL and ``server.downloads``
    counts the downloads per requested path, query included (``blobs.tar.gz?node=1``
    lets a demo tell its clients apart). The server is always shut down on exit.

    Example:
        >>> import tempfile, urllib.request
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "hello.txt").write_text("hi")
        >>> with serve(folder) as server:
        ...     data = urllib.request.urlopen(server.url + "hello.txt").read()
        >>> data, server.downloads["hello.txt"]
        (b'hi', 1)
    """
    handler = functools.partial(_Quiet, directory=os.fspath(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.downloads, server.delay = Counter(), delay
    server.url = f"http://127.0.0.1:{server.server_address[1]}/"
    thread = threading.Thread(target=server.serve_forever, name="mgpu-lab-http", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def fetch_archive(url: str, root: str | os.PathLike, md5: str, progress: bool = False) -> str:
    """Download a ``.tar.gz`` into ``root`` unless it is there already, and extract it.

    The download goes to a private temporary file in ``root`` (``tempfile.mkstemp``:
    a random name, created exclusively, so nothing planted there is followed),
    torchvision checks its MD5, and only then is it renamed: another process never
    sees half a file under the final name. Not meant to run on several ranks of one node at once: one rank
    per node downloads (:func:`mgpu_lab.data.per_node.run_once`), the others wait.

    Args:
        url: where the archive is served.
        root: directory to download and extract into.
        md5: the archive's expected MD5.
        progress: show torchvision's progress bar.

    Returns:
        The extracted directory, ``root/<archive name without .tar.gz>``.

    Raises:
        RuntimeError: the download does not match ``md5`` (torchvision's check).

    Example:
        >>> import tempfile
        >>> from mgpu_lab.data import datasets
        >>> served = tempfile.mkdtemp()
        >>> _ = datasets.write_archive(datasets.synthetic_classification(20), f"{served}/blobs.tar.gz")
        >>> with serve(served) as server:   # the wrong checksum: nothing is kept under root
        ...     fetch_archive(server.url + "blobs.tar.gz", tempfile.mkdtemp(), md5="0" * 32)
        Traceback (most recent call last):
        ...
        RuntimeError: ...
    """
    from unittest import mock

    from torchvision.datasets import utils as tv_utils
    from torchvision.datasets.utils import check_integrity, extract_archive

    root = Path(root)
    filename = Path(urllib.parse.urlparse(url).path).name  # without any ?query
    final = root / filename
    out = root / filename.removesuffix(".tar.gz")
    if not check_integrity(final, md5):
        root.mkdir(parents=True, exist_ok=True)
        # A new file with a random name, created exclusively (mkstemp): no other user can
        # predict it or plant a symlink there for the download to write through.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=root)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            with mock.patch.object(tv_utils, "tqdm", tv_utils.tqdm if progress else _NoBar):
                tv_utils.download_url(url, os.fspath(root), tmp.name, md5)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the data from the node's other users
            os.replace(tmp, final)  # atomic: the final name only ever holds a complete, verified file
        except RuntimeError:  # torchvision's "File not found or corrupted."
            got = md5sum(tmp) if tmp.is_file() else "no file"
            raise RuntimeError(f"downloaded {url} but its MD5 is {got}, expected md5={md5!r}; pass the "
                               "archive's real checksum (data.md5sum on the server side)") from None
        finally:
            tmp.unlink(missing_ok=True)
    if not (out / "tensors.pt").is_file():
        # Extract beside the target and rename: a reader never sees half a directory.
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=root))
        try:
            extract_archive(os.fspath(final), os.fspath(staging))
            if not (staging / out.name).is_dir():
                raise RuntimeError(f"{final} holds {sorted(p.name for p in staging.iterdir())}, not a "
                                   f"{out.name}/ directory; make archives with data.write_archive")
            try:
                os.rename(staging / out.name, out)
            except OSError:  # another process got there first; its copy is complete
                pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return os.fspath(out)


def _umask() -> int:
    """This process's umask, read without changing it (Linux); the usual 022 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def simulate_nodes(ranks_per_node: int) -> int:
    """Make this rank believe it is on node ``rank // ranks_per_node`` (for demos and checks).

    Sets LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and NODE_RANK as torchrun would
    on a multi-node job, so :mod:`mgpu_lab.dist` reports the simulated layout.

    Returns:
        The simulated node index.

    Raises:
        ValueError: the world size is not a multiple of ``ranks_per_node``.

    Example:
        >>> from mgpu_lab import launch
        >>> launch(simulate_nodes, 4, 2)
        launch: 4 ranks · ...
        [0, 0, 1, 1]
    """
    me = mdist.info()
    if ranks_per_node < 1 or me.world_size % ranks_per_node:
        raise ValueError(f"simulate_nodes: world_size={me.world_size} is not a multiple of "
                         f"ranks_per_node={ranks_per_node}; launch a multiple of it")
    node = me.rank // ranks_per_node
    os.environ.update(LOCAL_RANK=str(me.rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
                      GROUP_RANK=str(node), NODE_RANK=str(node))
    return node
