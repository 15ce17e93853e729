"""Every code example in docs/ and README.md runs, and the API reference is current.

* Each ```python block is a complete program: it runs in its own process, in a
  fresh directory. A block that calls ``anyio.run`` runs once per event loop of
  the parametrization (the loop is chosen by making ``anyio.run`` default to it);
  other blocks run once.
* A block whose info string carries ``file=NAME`` is a file of a larger example,
  not a program: the page's other blocks run next to it. A page with a
  ``file=pyproject.toml`` block is a project: it is installed with pip first and
  the page's programs run with it importable. ``serve.py`` and ``client.py`` of
  the cookbook are run by the serving tests below, against a real uvicorn server.
* A block whose info string carries ``requires=KIND`` runs only where that device kind opens (e.g. CUDA);
  elsewhere it is skipped with the reason.
* ``docs/api.md`` equals what ``docs/build_api.py`` generates now, and the package diagram in
  ``docs/architecture.md`` what ``docs/build_architecture.py`` draws from the imports now.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
TIMEOUT = 60.0

_FENCE = re.compile(
    r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)

RUNNER = """
import runpy
import sys

import anyio

path, chosen, uvloop = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
chosen_options = {"use_uvloop": True} if uvloop else {}
_run = anyio.run


def run(func, *args, backend=None, backend_options=None):
    if backend is None:
        backend, backend_options = chosen, chosen_options
    return _run(func, *args, backend=backend, backend_options=backend_options)


anyio.run = run
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
"""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    attrs: tuple[tuple[str, str], ...]
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"

    @property
    def file(self) -> str | None:
        return dict(self.attrs).get("file")

    @property
    def is_async(self) -> bool:
        return "anyio.run(" in self.code

    @property
    def requires(self) -> str | None:
        """The device kind a ``requires=KIND`` block needs: it is skipped, with the reason, where that kind
        does not open."""
        return dict(self.attrs).get("requires")


def parse(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        words = m["info"].split()
        lang = words[0].lower() if words else ""
        attrs = tuple((key, value) for key, _, value in (w.partition("=") for w in words[1:] if "=" in w))
        indent = len(m["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line for line in m["body"].splitlines(True))
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, lang, attrs, textwrap.dedent(body)))
    return found


BLOCKS = [b for page in PAGES for b in parse(page)]
PROGRAMS = [b for b in BLOCKS if b.lang == "python" and b.file is None]
FILES = [b for b in BLOCKS if b.file is not None]
COOKBOOK = DOCS / "cookbook.md"
# The file blocks each run by a dedicated test (a project's files are installed; see project_sites).
USED_FILES = {("cookbook.md", "serve.py"), ("cookbook.md", "client.py")}


def _files(page: Path) -> dict[str, str]:
    return {b.file: b.code for b in FILES if b.page == page and b.file is not None}


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every example: a private compile cache shared by all of them."""
    cache = tmp_path_factory.mktemp("docs-cache")
    cache.chmod(0o700)
    env = dict(os.environ)
    env["ARUNTIME_CACHEDB"] = str(cache / "cache.db")
    env.pop("ARUNTIME_DEFAULT_FLOAT", None)
    return env


@pytest.fixture(scope="session")
def project_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """Pages that hold a project (a ``file=pyproject.toml`` block) -> the directory pip installed it into."""
    sites: dict[Path, Path] = {}
    for page in PAGES:
        files = _files(page)
        if "pyproject.toml" not in files:
            continue
        root = tmp_path_factory.mktemp(f"project-{page.stem}")
        src = root / "src"
        src.mkdir()
        for name, code in files.items():
            (src / name).write_text(code)
        site = root / "site"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"]
        proc = subprocess.run([*cmd, "--target", str(site), str(src)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"installing the project of {page.name} failed:\n{proc.stdout}{proc.stderr}"
        sites[page] = site
    return sites


def _prepare(block: Block, cwd: Path, env: dict[str, str], sites: dict[Path, Path]) -> tuple[Path, dict[str, str]]:
    if block.requires is not None:
        from aruntime import Device, DeviceError

        try:
            Device[block.requires]
        except DeviceError as exc:
            pytest.skip(f"the example needs a {block.requires} device: {exc}")
    env = dict(env)
    site = sites.get(block.page)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    else:
        for name, code in _files(block.page).items():
            (cwd / name).write_text(code)
    script = cwd / "example.py"
    script.write_text(block.code)
    (cwd / "run_example.py").write_text(RUNNER)
    return script, env


def _report(block: Block, returncode: int, out: str, err: str) -> str:
    return f"the example at {block.page.relative_to(ROOT)} line {block.line} exited {returncode}:\n{out}\n{err}"


@pytest.mark.parametrize("block", [b for b in PROGRAMS if b.is_async], ids=lambda b: b.id)
async def test_async_example_runs(
    block: Block, anyio_backend: Any, tmp_path: Path, docs_env: dict[str, str], project_sites: dict[Path, Path]
) -> None:
    backend, options = anyio_backend
    script, env = _prepare(block, tmp_path, docs_env, project_sites)
    cmd = [sys.executable, "run_example.py", str(script), backend, "1" if options.get("use_uvloop") else "0"]
    with anyio.fail_after(TIMEOUT):
        proc = await anyio.run_process(cmd, cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 0, _report(block, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


@pytest.mark.parametrize("block", [b for b in PROGRAMS if not b.is_async], ids=lambda b: b.id)
def test_example_runs(block: Block, tmp_path: Path, docs_env: dict[str, str], project_sites: dict[Path, Path]) -> None:
    script, env = _prepare(block, tmp_path, docs_env, project_sites)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, _report(block, proc.returncode, proc.stdout, proc.stderr)


def test_every_example_is_run() -> None:
    """No page hides an example: programs exist, and every file block is run by some test."""
    assert PROGRAMS, "no python blocks found"
    pages_with_projects = {b.page.name for b in FILES if b.file == "pyproject.toml"}
    used = USED_FILES | {(b.page.name, b.file) for b in FILES if b.page.name in pages_with_projects}
    unused = {(b.page.name, b.file) for b in FILES} - used
    assert not unused, f"file blocks that no test runs: {sorted(map(str, unused))}"
    missing = USED_FILES - {(b.page.name, b.file) for b in FILES}
    assert not missing, f"file blocks the tests expect are gone: {sorted(missing)}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors a page offers: GitHub's slugs of its headings, and explicit ``<a id=...>``."""
    text = _FENCE.sub("", page.read_text())
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return slugs | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_links_between_pages_resolve() -> None:
    for page in PAGES:
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            assert dest.exists(), f"{page.name} links to {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.name} links to {target}: no such heading"


# --- the API reference ------------------------------------------------------------------------------------


def test_api_reference_is_current(tmp_path: Path) -> None:
    out = tmp_path / "api.md"
    proc = subprocess.run(
        [sys.executable, str(DOCS / "build_api.py"), "-o", str(out)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    generated = out.read_text()
    import aruntime

    for name in aruntime.__all__:
        assert f"`{name}" in generated, f"aruntime.{name} is missing from the API reference"
    committed = (DOCS / "api.md").read_text()
    stamp, now = committed.partition("\n")[0], generated.partition("\n")[0]
    if stamp != now:  # signatures render differently across Python and pdoc versions
        pytest.skip(f"docs/api.md was generated with other versions: {stamp} (here: {now})")
    assert generated == committed, "docs/api.md is out of date: run python docs/build_api.py"


def test_architecture_diagram_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(DOCS / "build_architecture.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (DOCS / "architecture.md").read_text()
    for package in ("memory", "compile", "engine", "device", "backends", "scheduler", "profile"):
        assert f'{package}["{package}"]' in page, f"the package diagram has no {package}"


# --- the serving example: uvicorn serving docs/cookbook.md's serve.py -----------------------------------


@dataclass
class Server:
    url: str
    cwd: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, docs_env: dict[str, str]) -> Any:
    """uvicorn serving the cookbook's ``serve.py`` on 127.0.0.1 (a free port); stopped with Ctrl-C afterwards."""
    cwd = tmp_path_factory.mktemp("serve")
    for name, code in _files(COOKBOOK).items():
        (cwd / name).write_text(code)
    (cwd / "run_example.py").write_text(RUNNER)
    cmd = [sys.executable, "-m", "uvicorn", "serve:app", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=docs_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    url = None
    deadline = time.monotonic() + TIMEOUT
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        for line in list(lines):
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m[1]
        time.sleep(0.05)
    if url is None:
        proc.kill()
        pytest.fail("uvicorn did not start:\n" + "".join(lines))
    try:
        yield Server(url, cwd, docs_env)
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does: graceful shutdown, the lifespan's exit runs
        try:
            status = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        reader.join(5)
        log = "".join(lines)
    assert status == 0, log
    assert "Application shutdown complete." in log and "Traceback" not in log, log


async def test_serving_example_client(server: Server, anyio_backend: Any) -> None:
    """The cookbook's client.py, run as written against the running server."""
    backend, options = anyio_backend
    env = dict(server.env, SERVE_URL=server.url)
    cmd = [sys.executable, "run_example.py", "client.py", backend, "1" if options.get("use_uvloop") else "0"]
    with anyio.fail_after(TIMEOUT):
        proc = await anyio.run_process(cmd, cwd=server.cwd, env=env, check=False)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert "20 requests ok" in out


async def test_serving_example_answers_concurrent_requests(server: Server) -> None:
    httpx = pytest.importorskip("httpx")
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            values = [float(i), float(i + 1), -0.5 * i]
            r = await client.post("/scale", json={"values": values, "by": 3})
            results[i] = (r.status_code, r.json())

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        for i, (status, body) in results.items():
            assert status == 200 and body == {"values": [3.0 * i, 3.0 * (i + 1), -1.5 * i]}, (i, status, body)
        big = await client.post("/scale", json={"values": [1.0] * 100_000, "by": 0.5})
        assert big.status_code == 200 and big.json()["values"] == [0.5] * 100_000

        bad = await client.post("/scale", content=b"{not json")
        assert bad.status_code == 400 and "error" in bad.json()
        wrong = await client.post("/scale", json={"values": "abc", "by": 2})
        assert wrong.status_code == 400
        assert (await client.get("/scale")).status_code == 405
        assert (await client.get("/nowhere")).status_code == 404
