"""The package as users install it (issue 14): pip into a venv that sees
Debian's torch, offline (no index; without a network namespace when `unshare`
allows), from a copy of the checked-in sources, then used from a directory
outside the source tree; a wheel; an editable install.

The fast tests hand setup.py the library the build already made
(ATTNKIT_PREBUILT_LIBRARY); the slow one lets pip build it with CMake, as a
user's `pip install .` does."""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = os.environ.get("ATTNKIT_LIBRARY", str(ROOT / "build" / "libattnkit.so"))
USE = """
import attnkit, torch, pathlib, sys
assert pathlib.Path(attnkit.library_path).is_relative_to(sys.prefix) or {editable}, attnkit.library_path
torch.manual_seed(0)
mha = attnkit.nn.MultiheadAttention(16, 2, attention="improved-clustered:clusters=3,topk=4", batch_first=True)
x = torch.randn(2, 9, 16, requires_grad=True)
mha(x, x, x)[0].sum().backward()
assert x.grad.abs().sum() > 0
print("ok", attnkit.__version__, attnkit.library_path)
"""


def offline(command):
    """`command` without network access when the kernel lets us make a network namespace."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-rn", *command]
    return command


def run(command, cwd, env=None, timeout=1800):
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNKIT_LIBRARY")}
    result = subprocess.run(list(map(str, command)), cwd=cwd, env={**clean, "PIP_NO_INDEX": "1", **(env or {})},
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


# What a clean clone does not have: build trees, installs, caches.
UNTRACKED = shutil.ignore_patterns("build*", ".venv", "dist", "__pycache__", "*.egg-info", ".git", "lib")


@pytest.fixture
def source(tmp_path):
    """The sources as a clean clone has them: the checked-in files when git
    can list them, else the tree without build products (a CI machine may
    have the checkout but no git)."""
    out = tmp_path / "src"
    listed = None
    if shutil.which("git"):
        result = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True)
        if result.returncode == 0:
            listed = [name for name in result.stdout.decode().split("\0") if name]
    if listed is None:
        shutil.copytree(ROOT, out, ignore=UNTRACKED)
        return out
    for name in listed:
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


@pytest.fixture
def venv(tmp_path):
    path = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", path], check=True)
    return path


def pip_install(venv, source, *extra, env=None):
    return run(offline([venv / "bin" / "pip", "install", "--no-build-isolation", "--no-index", *extra, "."]),
               cwd=source, env=env)


def test_pip_install_works_outside_the_source_tree(venv, source, tmp_path):
    pip_install(venv, source, env={"ATTNKIT_PREBUILT_LIBRARY": LIBRARY})
    shutil.rmtree(source)  # nothing may still come from the sources
    out = run([venv / "bin" / "python", "-c", USE.format(editable=False)], cwd=tmp_path)
    assert out.startswith("ok 0.1.0"), out


def test_wheel_holds_the_package_and_the_library(source, tmp_path):
    run(offline([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", tmp_path / "dist"]),
        cwd=source, env={"ATTNKIT_PREBUILT_LIBRARY": LIBRARY})
    wheels = list((tmp_path / "dist").glob("attnkit-*.whl"))
    assert len(wheels) == 1, wheels
    assert "linux_x86_64" in wheels[0].name, "a wheel with a compiled library is platform-specific"
    names = zipfile.ZipFile(wheels[0]).namelist()
    for member in ("attnkit/__init__.py", "attnkit/nn.py", "attnkit/models.py", "attnkit/lib/libattnkit.so"):
        assert member in names, names


def test_editable_install_uses_the_source_tree(venv, source, tmp_path):
    pip_install(venv, source, "-e", env={"ATTNKIT_PREBUILT_LIBRARY": LIBRARY})
    out = run([venv / "bin" / "python", "-c", USE.format(editable=True)], cwd=tmp_path)
    assert str(source / "python" / "attnkit" / "lib") in out, out


@pytest.mark.slow
def test_clean_clone_builds_the_library_with_cmake(venv, source, tmp_path):
    env = {"ATTNKIT_JOBS": os.environ.get("ATTNKIT_JOBS", str(os.cpu_count() or 1))}
    pip_install(venv, source, env=env)
    shutil.rmtree(source)
    out = run([venv / "bin" / "python", "-c", USE.format(editable=False)], cwd=tmp_path)
    assert out.startswith("ok 0.1.0"), out
