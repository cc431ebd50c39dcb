"""Run one notebook's check cell through a running JupyterLab's kernel, as a learner's browser would.

``python lab_check.py URL TOKEN NOTEBOOK [SOLUTION]`` (CI's learner-install step runs it with the
learner's Python): reads NOTEBOOK from the server (REST ``/api/contents``), starts a kernel
(``/api/kernels``), and over the kernel's websocket runs the notebook's first code cell (its imports),
the first exercise's cell as handed out and that exercise's check cell, which must say ``not
attempted``. Given SOLUTION (the instructor's notebook, from the clone: never in the install), it
then runs that exercise's answer from SOLUTION and the check cell again, which must say ``passed``.
Exits 0 when both hold, 1 otherwise, printing what the check cells printed.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import urllib.request
import uuid

from tornado.websocket import websocket_connect


def rest(url: str, token: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


def first_exercise(cells: list[dict]) -> tuple[int, int, str]:
    """(index of the answer cell, index of its check cell, exercise id) of the notebook's first check."""
    for i, cell in enumerate(cells):
        found = re.match(r'\s*check\("([^"]+)"', cell["source"]) if cell["cell_type"] == "code" else None
        if found:
            answer = max(j for j in range(i) if cells[j]["cell_type"] == "code")
            return answer, i, found.group(1)
    raise SystemExit("lab_check: the notebook has no check cell")


async def execute(ws, code: str, timeout: float = 600) -> tuple[str, str]:
    """Run ``code`` in the kernel; (status of the reply, everything it printed or displayed as text)."""
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": "ci", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    texts, status, idle = [], None, False
    while status is None or not idle:
        raw = await asyncio.wait_for(ws.read_message(), timeout)
        if raw is None:
            raise SystemExit("lab_check: the kernel's websocket closed")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            texts.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            texts.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            texts.append("\n".join(content["traceback"]))
        elif kind == "execute_reply":
            status = content["status"]
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True
    return status, "".join(texts)


async def main(url: str, token: str, notebook: str, solution: str | None) -> int:
    cells = rest(url, token, f"/api/contents/{notebook}")["content"]["cells"]
    answer, check_cell, exercise = first_exercise(cells)
    kernel = rest(url, token, "/api/kernels", "POST", {"name": "python3"})
    print(f"lab_check: {notebook} served; kernel {kernel['id']} started; exercise {exercise}", flush=True)
    ws = await websocket_connect(f"{url.replace('http', 'ws', 1)}/api/kernels/{kernel['id']}/channels?token={token}")
    try:
        steps = [("imports", cells[1]["source"], None), ("the cell as handed out", cells[answer]["source"], None),
                 ("its check", cells[check_cell]["source"], "not attempted")]
        if solution:
            solved = json.load(open(solution, encoding="utf-8"))["cells"]
            steps += [("the instructor's answer", "".join(solved[answer]["source"]), None),
                      ("its check again", cells[check_cell]["source"], "passed")]
        for name, code, expected in steps:
            status, out = await execute(ws, code)
            print(f"lab_check: {name}: {status}" + (f"\n{out.strip()}" if expected else ""), flush=True)
            if status != "ok" or (expected and expected not in out):
                print(f"lab_check: FAILED at {name}: expected {expected or 'status ok'}\n{out[-3000:]}")
                return 1
    finally:
        ws.close()
        rest(url, token, f"/api/kernels/{kernel['id']}", "DELETE")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        raise SystemExit(__doc__)
    sys.exit(asyncio.run(main(*sys.argv[1:4], sys.argv[4] if len(sys.argv) == 5 else None)))
