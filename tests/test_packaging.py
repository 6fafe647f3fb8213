"""Packaging: the metadata, and (slow) the sdist and wheel as a user gets them.

Fast: the installed version is ``lightning_zero.__version__`` (one source), and ``pyproject.toml`` lists every
subpackage of ``lightning_zero`` and ships every data file in them (a module or a yaml left out of the wheel passes
every other test, which run against the source tree).

Slow: ``python -m build`` on a clean copy of the work tree (tracked plus untracked-but-not-ignored files, so a stray
``build/`` or ``*.egg-info`` of the checkout cannot leak in, and the checkout gets none), the wheel built from the
sdist as a release would; ``twine check --strict`` on both; then the wheel in a fresh virtual environment, run as
``lightning-zero-train`` from an unrelated directory: ``--help``, ``--cfg job`` and a 2-step, 2-process
``zero3_scratch`` run, and the example copied out of the checkout. The venv sees the environment's packages
(``--system-site-packages``: torch first, as a user installs it, then the wheel without dependencies), so the test
needs no network.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import lightning_zero
from tests.helpers.cli import CliRun, cli_env, run_command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO_ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "lightning-zero"
# Besides the rank variables (tests/helpers/cli.py drops those): variables that could put the checkout or another
# environment ahead of the installed wheel.
_STRIP_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def _setuptools_config() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dir(package: str, package_dirs: dict[str, str]) -> Path:
    """Where setuptools takes ``package`` from: the longest ``package-dir`` prefix, else the dotted path."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dirs:
            return REPO_ROOT / package_dirs[prefix] / Path(*parts[i:])
    return REPO_ROOT / Path(*parts)


# ---- fast -------------------------------------------------------------------------------------------------------


def test_installed_version_is_the_package_version() -> None:
    """``[tool.setuptools.dynamic]`` takes the version from ``lightning_zero.__version__``: one source."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _setuptools_config()["dynamic"]["version"] == {"attr": "lightning_zero.__version__"}
    assert importlib.metadata.version(DIST_NAME) == lightning_zero.__version__, (
        "the installed metadata is stale: reinstall with  pip install -e '.[test]'"
    )


def test_pyproject_lists_every_subpackage() -> None:
    config = _setuptools_config()
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for init in (REPO_ROOT / "lightning_zero").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "lightning_zero.conf" in listed and config["package-dir"]["lightning_zero.conf"] == "conf"
    for package in listed:
        assert (_package_dir(package, config["package-dir"]) / "__init__.py").is_file(), package


def test_package_data_covers_every_data_file() -> None:
    """Every non-Python file in a listed package (conf/**/*.yaml, py.typed) matches a package-data glob."""
    config = _setuptools_config()
    package_data: dict[str, list[str]] = config["package-data"]
    missed = []
    for package in config["packages"]:
        root = _package_dir(package, config["package-dir"])
        covered = {p for pattern in package_data.get(package, []) for p in root.glob(pattern)}
        for path in root.rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc", ".pyo") or "__pycache__" in path.parts:
                continue
            # A file in a subpackage belongs to that subpackage's package-data, not to this one.
            owner = next(
                (p for p in path.relative_to(root).parents if p != Path(".") and (root / p / "__init__.py").exists()),
                None,
            )
            if owner is None and path not in covered:
                missed.append(str(path.relative_to(REPO_ROOT)))
    assert missed == [], "not shipped: add a glob to [tool.setuptools.package-data] in pyproject.toml"
    assert (REPO_ROOT / "lightning_zero" / "py.typed").is_file()
    assert (REPO_ROOT / "conf" / "train.yaml").is_file()


# ---- slow: build, check, install, run ---------------------------------------------------------------------------


def _clean_copy(dest: Path) -> Path:
    """The work tree as a fresh clone plus uncommitted work would have it: no build/, dist/, *.egg-info, caches."""
    dest.mkdir()
    if (REPO_ROOT / ".git").exists() and shutil.which("git"):
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
        ).stdout.decode()
        for rel in filter(None, listing.split("\0")):
            src = REPO_ROOT / rel
            if src.is_file():  # tracked files deleted in the work tree are listed too
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:  # an unpacked sdist: no git metadata to ask
        ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".*", "outputs", "*.py[cod]")
        shutil.copytree(REPO_ROOT, dest, ignore=ignore, dirs_exist_ok=True)
    return dest


def _run(cmd: list[str | Path], cwd: Path, timeout: float) -> CliRun:
    """Run ``cmd`` in its own session (see :func:`tests.helpers.cli.run_command`), without rank or path variables."""
    return run_command([str(c) for c in cmd], cwd, timeout, cli_env(pin_port=False, strip=_STRIP_VARS))


def _ok(result: CliRun) -> str:
    assert result.returncode == 0, f"{' '.join(result.args)} exited {result.returncode}:\n{result.stdout[-6000:]}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_and_sdist_build_check_install_and_run(tmp_path: Path) -> None:
    src = _clean_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist, so the wheel's contents
    # prove that the sdist carries conf/ and everything else the build needs.
    _ok(_run([sys.executable, "-m", "build", "--outdir", dist, src], cwd=tmp_path, timeout=300))
    version = lightning_zero.__version__
    (sdist,) = dist.glob(f"lightning_zero-{version}.tar.gz")
    (wheel,) = dist.glob(f"lightning_zero-{version}-py3-none-any.whl")
    _ok(_run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel], cwd=tmp_path, timeout=120))

    with tarfile.open(sdist) as tf:
        in_sdist = {name.split("/", 1)[-1] for name in tf.getnames()}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "conf/train.yaml", "lightning_zero/py.typed"} <= in_sdist

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = f"lightning_zero-{version}.dist-info"
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert {"lightning_zero/conf/train.yaml", "lightning_zero/conf/strategy/zero3_scratch.yaml"} <= names
    assert "lightning_zero/py.typed" in names
    # Every module and every config of the source tree, and nothing from outside the package.
    expected = {p.relative_to(src).as_posix() for p in (src / "lightning_zero").rglob("*.py")}
    expected |= {
        "lightning_zero/conf/" + p.relative_to(src / "conf").as_posix()
        for pattern in ("**/*.py", "**/*.yaml")
        for p in (src / "conf").glob(pattern)
    }
    assert expected - names == set(), "in the source tree but not in the wheel"
    assert {n.split("/")[0] for n in names} == {"lightning_zero", dist_info}
    # Every console script of pyproject.toml (lightning-zero-train and any other) is declared in the wheel.
    scripts = tomllib.loads((src / "pyproject.toml").read_text())["project"]["scripts"]
    assert "lightning-zero-train" in scripts and "[console_scripts]" in entry_points
    for name, target in scripts.items():
        assert f"{name} = {target}" in entry_points, entry_points
    assert f"Version: {version}" in metadata and "Description-Content-Type: text/markdown" in metadata

    # A fresh venv that reuses the installed torch/lightning/hydra; the wheel goes into the venv itself, and no
    # copy of lightning_zero outside it (the checkout, an editable install) may be the one that runs.
    venv = tmp_path / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=tmp_path, timeout=120))
    python, cli = venv / "bin" / "python", venv / "bin" / "lightning-zero-train"
    pip_install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--ignore-installed", wheel]
    _ok(_run(pip_install, cwd=tmp_path, timeout=180))
    assert all((venv / "bin" / name).is_file() for name in scripts), sorted(p.name for p in (venv / "bin").iterdir())
    show = "import lightning_zero, lightning_zero.conf as c; print(lightning_zero.__file__, c.__file__)"
    where = _ok(_run([python, "-c", show], cwd=tmp_path, timeout=120)).split()
    assert len(where) == 2 and all(Path(p).resolve().is_relative_to(venv.resolve()) for p in where), where

    help_text = _ok(_run([cli, "--help"], cwd=tmp_path, timeout=120))
    assert "strategy: " in help_text and "zero3_scratch" in help_text, help_text[-4000:]
    # The example, copied out of the checkout, against the wheel: what a user of the release runs first.
    example = tmp_path / "example" / "train_ddp_scratch.py"
    example.parent.mkdir()
    shutil.copy2(src / "examples" / "train_ddp_scratch.py", example)
    out = _ok(_run([python, example], cwd=example.parent, timeout=180))
    assert re.search(r"final val_mse=[\d.]+ after \d+ optimizer steps", out), out[-4000:]

    job = _ok(_run([cli, "--cfg", "job"], cwd=tmp_path, timeout=120))
    assert "_target_: lightning_zero.ZeroStrategy" in job and "stage: 3" in job, job[-4000:]

    run_dir = tmp_path / "run"
    args = [
        "trainer=ddp_sim",
        "strategy=zero3_scratch",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "model.n_layer=1",
        "model.n_embd=32",
        "data.max_chars=40000",
        f"paths.log_dir={tmp_path / 'out'}",
        f"hydra.run.dir={run_dir}",
    ]
    out = _ok(_run([cli, *args], cwd=tmp_path, timeout=240))
    # Lightning's popen launcher started rank 1 from the same console script of the venv.
    rank1_log = run_dir / "train_ddp_process_1.log"
    assert rank1_log.is_file() and "rank 1 of 2" in rank1_log.read_text(), out[-6000:]
    assert (run_dir / "checkpoints" / "last.ckpt").exists(), out[-6000:]
