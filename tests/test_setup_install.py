"""The set-up's install commands on a user's machine: the lock's CPU torch alone, from PyTorch's
CPU index when that is reachable and from a wheel on disk when it is not, then everything else
from the ordinary index alone.

``make setup`` runs ``tools/pip_install.py`` (the one owner of the commands; the first test pins
that). Here the same script runs in a fresh venv with a clean pip (no pip.conf, no ``PIP_*``, no
cache) against a stand-in served on localhost for what the user's machine reaches: PyPI (every
pin; torch only as PyPI carries it, the public version with its CUDA wheels) and PyTorch's CPU
index (the lock's ``+cpu`` torch and the packages it mirrors). The pages are PEP 503 simple pages
with PEP 658 metadata files, built from the installed distributions' own METADATA and WHEEL tags,
so pip's resolver reads every pin's real dependencies without a wheel. Real files: pip and
setuptools (the venv's pip, the editable build's backend) and a stand-in torch wheel holding the
installed torch's metadata only, which step 1 really installs; step 2 runs with ``--dry-run
--report``. Emulated because it cannot be reached from here: the two indexes themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO_ROOT, requires_tool, skip_or_fail, subprocess_env

SCRIPT = REPO_ROOT / "tools" / "pip_install.py"
PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
CUDA_DEPENDENCY = "nvidia-cuda-runtime-cu12"
"""Stands for the NVIDIA wheels PyPI's x86_64 torch requires (several GB in all)."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[_canonical(name)] = version
    return pins


def _filename(name: str, version: str, tags: list[str]) -> str:
    """A wheel's file name (PEP 427) with its compressed tag set."""
    parts = [list(dict.fromkeys(tag.split("-")[i] for tag in tags)) for i in range(3)]
    tag = "-".join(".".join(values) for values in parts)
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-{tag}.whl"


class StandIn:
    """PyPI at ``/pypi/<project>/``, PyTorch's CPU index at ``/cpu/<project>/``, files at
    ``/files/``; records the pages and the wheels pip asked for. ``torch_wheel`` is served as
    the CPU index's torch file."""

    def __init__(self, real_wheels: dict[str, Path], torch_wheel: Path) -> None:
        self.pages: dict[str, dict[str, list[str]]] = {"pypi": {}, "cpu": {}}
        self.metadata: dict[str, bytes] = {}
        self.real = {path.name: path for path in [*real_wheels.values(), torch_wheel]}
        self.fetched: list[str] = []
        self.requested: list[str] = []
        mirrored: set[str] = set()
        pins = _pins()
        for dist in importlib.metadata.distributions():
            name = _canonical(dist.metadata["Name"])
            if pins.get(name) != dist.version:
                continue
            wheel = dist.read_text("WHEEL") or ""
            tags = [line.split(": ")[1] for line in wheel.splitlines() if line.startswith("Tag:")]
            text = (dist.read_text("METADATA") or "").encode()
            if name == "torch":  # the lock's +cpu build: only PyTorch's CPU index has it
                self._add("cpu", name, torch_wheel.name, text)
                public = dist.version.split("+")[0]
                cuda = text.replace(
                    f"Version: {dist.version}".encode(), f"Version: {public}".encode()
                )
                cuda = cuda.replace(
                    b"\n\n", f"\nRequires-Dist: {CUDA_DEPENDENCY}==12.8.90\n\n".encode(), 1
                )
                self._add("pypi", name, _filename(name, public, tags), cuda)
                mirrored = {
                    _canonical(re.split(r"[ ;<>=!~\[(]", r)[0]) for r in dist.requires or []
                }
                continue
            self._add("pypi", name, _filename(name, dist.version, tags), text)
        for name in mirrored:  # the CPU index also serves torch's dependencies
            self.pages["cpu"][name] = self.pages["pypi"].get(name, [])
        for path in self.real.values():
            self.pages["pypi"].setdefault(_canonical(path.name.split("-")[0]), []).append(path.name)

    def _add(self, index: str, name: str, filename: str, metadata: bytes) -> None:
        self.pages[index].setdefault(name, []).append(filename)
        self.metadata[filename] = metadata

    def page(self, index: str, project: str) -> bytes | None:
        files = self.pages[index].get(project)
        if files is None:
            return None
        links = []
        for filename in files:
            meta = self.metadata.get(filename)
            attrs = ""
            if meta is not None:  # PEP 658 (and PEP 714's newer name)
                digest = hashlib.sha256(meta).hexdigest()
                attrs = f' data-dist-info-metadata="sha256={digest}"'
                attrs += f' data-core-metadata="sha256={digest}"'
            links.append(f'<a href="/files/{filename}"{attrs}>{filename}</a><br>')
        return f"<!DOCTYPE html><html><body>{''.join(links)}</body></html>".encode()

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = urllib.parse.unquote(self.path.split("?")[0])
                parts = [part for part in path.split("/") if part]
                stand_in.requested.append(path)
                body: bytes | None = None
                kind = "text/html"
                if len(parts) == 2 and parts[0] in stand_in.pages:
                    body = stand_in.page(parts[0], _canonical(parts[1]))
                elif len(parts) == 2 and parts[0] == "files":
                    name = parts[1]
                    kind = "application/octet-stream"
                    if name.endswith(".metadata"):
                        body = stand_in.metadata.get(name.removesuffix(".metadata"))
                    else:
                        stand_in.fetched.append(name)
                        if name in stand_in.real:
                            body = stand_in.real[name].read_bytes()
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def real_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """pip's and setuptools' wheels, fetched the way this machine's pip is configured."""
    out = tmp_path_factory.mktemp("wheels")
    got = subprocess.run(
        [*PIP_DOWNLOAD, "-d", str(out), "pip", "setuptools>=77"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if got.returncode:
        skip_or_fail(f"pip download of pip and setuptools failed (reach an index): {got.stderr}")
    return {path.name.split("-")[0]: path for path in out.glob("*.whl")}


def _torch_dist() -> importlib.metadata.Distribution:
    return importlib.metadata.distribution("torch")


@pytest.fixture(scope="module")
def torch_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for the lock's ``torch-<pin>`` wheel: the installed torch's METADATA and WHEEL
    tags, no code (a few KB instead of ~200 MB), so pip installs it like the real one."""
    dist = _torch_dist()
    pin = _script().torch_pin()
    assert dist.version == pin, f"the venv's torch {dist.version} is not the lock's {pin}"
    wheel_text = dist.read_text("WHEEL") or ""
    tags = [line.split(": ")[1] for line in wheel_text.splitlines() if line.startswith("Tag:")]
    path = tmp_path_factory.mktemp("torch-wheel") / _filename("torch", pin, tags)
    info = f"torch-{pin}.dist-info"
    files = {f"{info}/METADATA": dist.read_text("METADATA") or "", f"{info}/WHEEL": wheel_text}
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(name, text)
    return path


@pytest.fixture
def fresh_python(tmp_path: Path, real_wheels: dict[str, Path]) -> Path:
    """A new venv with the newest pip. make setup uses the pip the venv's Python bundles; this
    test needs a newer one only for the stand-in, which serves metadata alone (pip 23.2, this
    Python's bundled pip, still downloads some wheels and meets a 404 here, not on PyPI)."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = real_wheels["pip"]
    subprocess.run(
        [python, f"{pip}/pip", "install", "-q", "--no-index", "--no-cache-dir", str(pip)],
        check=True,
        timeout=300,
        env=_clean_env(),
    )
    return python


def _clean_env(**extra: str) -> dict[str, str]:
    """No pip configuration from this machine: no pip.conf, no PIP_* variable, no cache."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", **extra)
    return env


def _installed_torch(python: Path) -> str | None:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


def _resolve(python: Path, report: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, SCRIPT, "--dry-run", "--report", str(report), "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _installs(report: Path) -> dict[str, dict]:
    items = json.loads(report.read_text())["install"]
    return {_canonical(item["metadata"]["name"]): item for item in items}


def _script():
    spec = importlib.util.spec_from_file_location("pip_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("platform", "machine", "version", "says"),
    [
        ("linux", "x86_64", (3, 11), None),
        ("linux", "x86_64", (3, 12), None),
        ("linux", "x86_64", (3, 13), "Python 3.13 has no wheels for every pin"),
        ("linux", "aarch64", (3, 11), "needs Linux x86_64, this is linux aarch64"),
        ("darwin", "arm64", (3, 11), "needs Linux x86_64, this is darwin arm64"),
    ],
)
def test_a_machine_the_lock_cannot_serve_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, platform: str, machine: str, version: tuple, says: str | None
) -> None:
    script = _script()
    monkeypatch.setattr(script.sys, "platform", platform)
    monkeypatch.setattr(script.platform, "machine", lambda: machine)
    monkeypatch.setattr(script.sys, "version_info", (*version, 0, "final", 0))
    reason = script.refusal()
    if says is None:
        assert reason is None
    else:
        assert reason is not None and says in reason and "\n" not in reason


@requires_tool("make")
def test_make_setup_runs_the_install_script_and_nothing_else_of_pip() -> None:
    """One owner: the recipe that builds the venv installs through tools/pip_install.py only (no
    unprobed ``pip install --upgrade pip``, which retries for minutes offline)."""
    recipe = subprocess.run(
        ["make", "-n", "-B", ".venv/.stamp"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert ".venv/bin/python tools/pip_install.py -q" in recipe, recipe
    assert not [line for line in recipe if "pip install" in line], recipe


@requires_tool("make")
def test_with_a_venv_the_check_runs_with_the_venvs_python() -> None:
    """The check asks the Python that will install (this worktree has .venv): a system Python
    that cannot run (PYTHON=false) is not asked."""
    assert (REPO_ROOT / ".venv/bin/python").exists()
    recipe = subprocess.run(
        ["make", "-n", "-B", ".venv/.stamp", "PYTHON=false"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    check = [line for line in recipe if line.endswith("tools/pip_install.py --check")]
    assert len(check) == 1, recipe
    ran = subprocess.run(["bash", "-c", check[0]], cwd=REPO_ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr


def test_the_torch_pin_is_read_from_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("filelock==3.0\nTorch==9.9.9+cpu\n")
    assert _script().torch_pin(lock) == "9.9.9+cpu"
    assert _script().torch_pin() == _pins()["torch"]
    lock.write_text("filelock==3.0\n")
    with pytest.raises(SystemExit, match="pins no torch"):
        _script().torch_pin(lock)
    assert _pins()["torch"] not in SCRIPT.read_text(), "the pin is written only in the lock"


def _commands(stdout: str) -> list[str]:
    return [line.removeprefix("+ ") for line in stdout.splitlines() if line.startswith("+ ")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_users_machine_installs_the_cpu_torch_alone_from_pytorchs_index(
    fresh_python: Path, real_wheels: dict[str, Path], torch_wheel: Path, tmp_path: Path
) -> None:
    """Step 1 takes torch from the CPU index only; step 2 resolves every other pin from PyPI
    alone (no extra index: no package can come from whichever index offers it)."""
    stand_in = StandIn(real_wheels, torch_wheel)
    report = tmp_path / "report.json"
    with stand_in.serve() as url:
        env = _clean_env(PIP_INDEX_URL=f"{url}/pypi", TORCH_INDEX_URL=f"{url}/cpu")
        done = _resolve(fresh_python, report, env)
    assert done.returncode == 0, done.stdout + done.stderr
    pins = _pins()
    torch_step, project_step = _commands(done.stdout)
    assert f"--index-url {url}/cpu" in torch_step and "--no-deps" in torch_step
    assert torch_step.endswith(f"torch=={pins['torch']}")
    assert "index-url" not in project_step and "-c " in project_step
    assert _installed_torch(fresh_python) == pins["torch"]
    assert f"/files/{torch_wheel.name}" in stand_in.requested
    # The CPU index was asked for torch only (the probe and step 1), never during step 2.
    assert {path for path in stand_in.requested if path.startswith("/cpu/")} == {"/cpu/torch/"}
    installs = _installs(report)
    assert "torch" not in installs  # installed by step 1, kept under the lock's pin
    assert CUDA_DEPENDENCY not in installs and not [n for n in installs if n.startswith("nvidia-c")]
    wrong = {n: i["metadata"]["version"] for n, i in installs.items() if n in pins}
    assert {n: v for n, v in wrong.items() if pins[n] != v} == {}
    assert set(pins) - {"pip", "setuptools", "torch"} <= set(installs), set(pins) - set(installs)
    # Resolved from metadata alone: no wheel but torch's and the build backend's was downloaded.
    assert all(
        name.startswith("setuptools-") or name == torch_wheel.name for name in stand_in.fetched
    ), stand_in.fetched


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_offline_the_wheel_on_disk_is_used_and_the_index_is_left_out(
    fresh_python: Path, real_wheels: dict[str, Path], torch_wheel: Path, tmp_path: Path
) -> None:
    links = tmp_path / "links"
    links.mkdir()
    (links / torch_wheel.name).symlink_to(torch_wheel)
    stand_in = StandIn(real_wheels, torch_wheel)
    report = tmp_path / "report.json"
    with stand_in.serve() as url:
        unreachable = f"http://127.0.0.1:{_closed_port()}/cpu"
        env = _clean_env(
            PIP_INDEX_URL=f"{url}/pypi", TORCH_INDEX_URL=unreachable, PIP_FIND_LINKS=str(links)
        )
        done = _resolve(fresh_python, report, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{unreachable} (TORCH_INDEX_URL) is out of reach" in done.stderr
    torch_step, project_step = _commands(done.stdout)
    assert "--no-index" in torch_step and unreachable not in done.stdout
    assert "index-url" not in project_step
    assert _installed_torch(fresh_python) == _pins()["torch"]
    assert f"/files/{torch_wheel.name}" not in stand_in.requested  # from the links directory
    installs = _installs(report)
    assert "torch" not in installs and not [n for n in installs if n.startswith("nvidia-c")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_without_the_cpu_index_or_a_wheel_pip_stops_with_the_fix(
    fresh_python: Path, real_wheels: dict[str, Path], torch_wheel: Path, tmp_path: Path
) -> None:
    """PyPI alone has no +cpu torch: step 1 stops, step 2 never runs, the last line says the
    fix and names TORCH_INDEX_URL."""
    stand_in = StandIn(real_wheels, torch_wheel)
    with stand_in.serve() as url:
        unreachable = f"http://127.0.0.1:{_closed_port()}/cpu"
        env = _clean_env(PIP_INDEX_URL=f"{url}/pypi", TORCH_INDEX_URL=unreachable)
        done = _resolve(fresh_python, tmp_path / "report.json", env)
    assert done.returncode != 0
    assert len(_commands(done.stdout)) == 1, done.stdout
    assert f"No matching distribution found for torch=={_pins()['torch']}" in done.stderr
    last = done.stderr.splitlines()[-1]
    assert f"{unreachable} is out of reach" in last and "set TORCH_INDEX_URL" in last, last
    assert "set PIP_FIND_LINKS" in last
    assert _installed_torch(fresh_python) is None
