"""The two image assets follow their image inputs and nothing else.

    .venv/bin/pytest tests/infra/test_image_context.py      # ~15 s

CDK fingerprints each asset's build context at synth (aws-cdk-lib's DockerImageAsset: the
directory after .dockerignore and `exclude`, Docker's matching rules); `cdk deploy` builds and
pushes an image only for a hash it has not pushed, and the store's pod template names its
image by that hash. Here a copy of the repository's tracked files is fingerprinted before and
after editing one file. What cannot run here: `docker build` itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import aws_cdk as cdk
import pytest

from infra.config import ImageConfig
from infra.image import REPO_ROOT, STORE_CONTEXT, STORE_DOCKERFILE, TrainerImage

CONFIG = ImageConfig(repository_name="fsdp-test", image_uri=None)

# Files whose edit must leave both images alone (deploy state, docs, the CDK app, tooling).
NOT_IMAGE_INPUTS = (
    ".gpu-nodes",
    ".first-deploy",
    ".last-deploy.template.json",
    "README.md",
    "Makefile",
    "cdk.json",
    "app.py",
    "planner/cli.py",
    "infra/stack.py",
    "tests/infra/test_image_context.py",
    "docs/day-two.md",
    ".ci/run",
)


def _copy_repo(root: Path) -> Path:
    """The repository's tracked files (and untracked, not ignored ones), copied to `root`."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        source = REPO_ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return _copy_repo(tmp_path / "repo")


@pytest.fixture(scope="module")
def untouched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[str, str]]:
    """One copy of the repository and its two hashes, for every file of NOT_IMAGE_INPUTS:
    each test edits its file and puts it back (the fingerprint reads contents and paths)."""
    root = _copy_repo(tmp_path_factory.mktemp("untouched") / "repo")
    return root, _hashes(root, tmp_path_factory.mktemp("before"))


def _hashes(directory: Path, outdir: Path) -> tuple[str, str]:
    app = cdk.App(outdir=str(outdir))
    image = TrainerImage(cdk.Stack(app, "S"), "Image", config=CONFIG, directory=directory)
    assert image.asset is not None
    return image.asset.asset_hash, image.store_asset.asset_hash


def _edit(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n# edited\n")


@pytest.mark.parametrize("name", NOT_IMAGE_INPUTS)
def test_deploy_state_and_docs_change_no_image(
    untouched: tuple[Path, tuple[str, str]], tmp_path: Path, name: str
) -> None:
    repo, before = untouched
    path = repo / name
    original = path.read_bytes() if path.is_file() else None
    try:
        _edit(path)
        assert _hashes(repo, tmp_path / "b") == before
    finally:
        if original is None:
            path.unlink()
        else:
            path.write_bytes(original)


def test_trainer_code_changes_the_trainer_image_only(repo: Path, tmp_path: Path) -> None:
    trainer, store = _hashes(repo, tmp_path / "a")
    _edit(repo / "training/trainer.py")
    new_trainer, new_store = _hashes(repo, tmp_path / "b")
    assert new_trainer != trainer
    assert new_store == store


def test_store_inputs_change_the_store_image(repo: Path, tmp_path: Path) -> None:
    trainer, store = _hashes(repo, tmp_path / "a")
    _edit(repo / STORE_DOCKERFILE)
    new_trainer, new_store = _hashes(repo, tmp_path / "b")
    assert new_trainer == trainer
    assert new_store != store
    _edit(repo / "training/launch/rdzv_store.py")  # in both images
    last_trainer, last_store = _hashes(repo, tmp_path / "c")
    assert last_trainer != trainer
    assert last_store != new_store


def test_store_context_holds_exactly_what_its_dockerfile_copies(tmp_path: Path) -> None:
    outdir = tmp_path / "out"
    app = cdk.App(outdir=str(outdir))
    image = TrainerImage(cdk.Stack(app, "S"), "Image", config=CONFIG)
    app.synth()
    staged = outdir / f"asset.{image.store_asset.asset_hash}"
    files = {str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()}
    assert files == {*STORE_CONTEXT, ".dockerignore"}
    dockerfile = (REPO_ROOT / STORE_DOCKERFILE).read_text()
    copied = set()
    for sources in re.findall(r"^COPY (.+) \S+$", dockerfile, flags=re.M):
        copied |= set(sources.split())
    assert copied | {STORE_DOCKERFILE} == set(STORE_CONTEXT)


def test_store_and_trainer_run_the_same_torch() -> None:
    """The launchers' TCPStore clients and the store speak one protocol version."""

    def torch_version(path: Path) -> str:
        return re.search(r"^ARG TORCH_VERSION=(\S+)$", path.read_text(), flags=re.M).group(1)

    assert torch_version(REPO_ROOT / STORE_DOCKERFILE) == torch_version(
        REPO_ROOT / "training/Dockerfile"
    )
