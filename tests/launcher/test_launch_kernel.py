"""launch from a real Jupyter kernel: cells define the function and the class."""
from __future__ import annotations

import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(300)


class Kernel:
    def __init__(self):
        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float = 120) -> dict:
        """Execute a cell; collect its streams, its error and its result."""
        out = {"stdout": "", "stderr": "", "error": None, "result": None}

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = (content["ename"], content["evalue"])
            elif kind == "execute_result":
                out["result"] = content["data"]["text/plain"]

        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return out

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.run("import torch, torch.distributed as dist\nfrom mgpu_lab import launch")
    try:
        yield k
    finally:
        k.close()


def test_function_and_class_defined_in_cells_run_in_every_rank(kernel):
    assert kernel.run("import torch, torch.distributed as dist\nfrom mgpu_lab import launch")["error"] is None
    kernel.run(
        "class Scale:\n"
        "    def __init__(self, k):\n"
        "        self.k = k\n"
        "    def __call__(self, t):\n"
        "        return t * self.k\n"
    )
    kernel.run(
        "def work(scale):\n"
        "    t = torch.tensor([dist.get_rank() + 1.0])\n"
        "    dist.all_reduce(t)\n"
        "    print('sum is', t.item())\n"
        "    return scale(t).item()\n"
    )
    out = kernel.run("launch(work, 2, Scale(10))")
    assert out["error"] is None, out
    assert out["result"] == "[30.0, 30.0]"
    assert out["stdout"].startswith("launch: 2 ranks · gloo · cpu")
    assert "[rank 0/2] sum is 3.0" in out["stdout"] and "[rank 1/2] sum is 3.0" in out["stdout"]


def test_a_failing_rank_shows_the_cell_source_in_the_traceback_and_the_kernel_lives(kernel):
    kernel.run(
        "def broken():\n"
        "    if dist.get_rank() == 1:\n"
        "        raise RuntimeError('cell bug')\n"
        "    dist.barrier()\n"
    )
    out = kernel.run("launch(broken, 2, timeout=60)")
    assert out["error"][0] == "LaunchError"
    assert "rank 1/2 raised RuntimeError: cell bug" in out["error"][1]
    assert "raise RuntimeError('cell bug')" in out["error"][1]  # source from the kernel's cells
    assert kernel.run("1 + 1")["result"] == "2"


def test_interrupting_the_kernel_stops_every_rank(kernel):
    kernel.run(
        "import os, time\n"
        "def sleeper():\n"
        "    print('pid', os.getpid(), flush=True)\n"
        "    time.sleep(1000)\n"
    )
    msg_id = kernel.kc.execute("launch(sleeper, 2, timeout=120)")
    pids, text, deadline = [], "", time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        msg = kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]
            pids = [int(line.split()[-1]) for line in text.splitlines() if " pid " in line]
    assert len(pids) == 2, text
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)[1]
    assert gone == []
    assert kernel.run("1 + 2")["result"] == "3"


def test_hundred_launches_leave_no_process_port_or_fd_behind(kernel):
    code = (
        "import psutil, os\n"
        "me = psutil.Process()\n"
        "def state():  # descendants, open fds, listening ports (the kernel's own ZMQ ports included)\n"
        "    ports = {c.laddr for c in me.net_connections('tcp') if c.status == psutil.CONN_LISTEN}\n"
        "    return {p.pid for p in me.children(recursive=True)}, len(os.listdir('/proc/self/fd')), ports\n"
        "launch(lambda: dist.get_rank(), 2)\n"
        "before = state()\n"
        "results = [launch(lambda: dist.get_rank(), 2) for _ in range(100)]\n"
        "after = state()\n"
        "print(results == [[0, 1]] * 100, before == after, len(before[0]))\n"
    )
    out = kernel.run(code, timeout=280)
    assert out["error"] is None, out
    # the forkserver and multiprocessing's resource tracker stay; no rank does
    assert out["stdout"].strip().splitlines()[-1] == "True True 2"
