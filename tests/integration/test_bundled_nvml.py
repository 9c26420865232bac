"""Zero-install GPU data: the agent bundle carries NVIDIA's ``pynvml`` (from the client's nvidia-ml-py), so a
host needs only ``python3`` and the driver. Checked with an interpreter that cannot see site-packages.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tui.link import ship

HAS_DRIVER_LIBRARY = ctypes.util.find_library("nvidia-ml") is not None


def _client_pynvml() -> Path:
    spec = importlib.util.find_spec("pynvml")
    assert spec is not None and spec.origin, "nvidia-ml-py is a dependency of the client"
    return Path(spec.origin)


def _bare_python(where: Path) -> str:
    """A venv interpreter without the system site-packages: like a host's python3 with nothing pip-installed."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    python = where / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import pynvml"], capture_output=True, timeout=30)
    assert probe.returncode != 0, "the bare interpreter must not find pynvml"
    return str(python)


def test_bundle_ships_pynvml_with_its_licence_and_version() -> None:
    with zipfile.ZipFile(io.BytesIO(ship.build_bundle_bytes())) as zf:
        names = set(zf.namelist())
        assert {"_vendor/pynvml.py", "_vendor/pynvml.LICENSE", "_vendor/pynvml.json"} <= names
        assert zf.read("_vendor/pynvml.py") == _client_pynvml().read_bytes()
        licence = zf.read("_vendor/pynvml.LICENSE").decode()
        manifest = json.loads(zf.read("_vendor/pynvml.json"))
    assert "NVIDIA Corporation" in licence and "Redistribution and use in source and binary forms" in licence
    assert manifest["distribution"] == "nvidia-ml-py"
    assert manifest["version"] == importlib.metadata.version("nvidia-ml-py")


def test_bundled_agent_without_site_packages_reaches_nvml_init(tmp_path: Path) -> None:
    pyz = ship.write_bundle(tmp_path / "bundle")
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1])\n"
        "from engine.host.capabilities import probe_nvml\n"
        "from engine.host.gpus import NvmlGpus\n"
        "gpus = NvmlGpus()\n"
        "print(json.dumps({'probe': probe_nvml(), 'sampler_error': gpus.error}))\n"
    )
    # -S: no site-packages at all, so the host has no pynvml of its own.
    done = subprocess.run([sys.executable, "-S", "-c", probe, str(pyz)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    text = json.dumps(result)
    assert "not installed" not in text and "ModuleNotFoundError" not in text, text
    assert "bundled nvidia-ml-py" in result["probe"]["binding"]
    if not HAS_DRIVER_LIBRARY:
        assert "libnvidia-ml.so.1 not found" in result["probe"]["detail"]
        assert "libnvidia-ml.so.1 not found" in (result["sampler_error"] or "")


@pytest.mark.ssh
def test_doctor_over_ssh_with_a_bare_python_names_the_driver_not_pynvml(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    args = sshd.args()
    args[args.index("--python") + 1] = _bare_python(tmp_path / "bare")
    r = cli("doctor", sshd.target, *args, "--run-root", str(run_root), timeout_s=120)
    lines = r.stdout.splitlines()
    nvml = next(i for i, ln in enumerate(lines) if ln.split()[:2] in (["PASS", "nvml"], ["FAIL", "nvml"]))
    assert "pynvml not installed" not in r.stdout and "pip install nvidia-ml-py" not in r.stdout, r.stdout
    if HAS_DRIVER_LIBRARY:
        assert lines[nvml].startswith("PASS"), r.stdout
    else:
        assert lines[nvml].startswith("FAIL") and "libnvidia-ml.so.1 not found" in lines[nvml], r.stdout
        fix = lines[nvml + 1]
        assert "fix:" in fix and "NVIDIA driver" in fix and "container" in fix, r.stdout


def test_without_any_pynvml_the_fix_blames_the_bundle_not_the_driver(tmp_path: Path) -> None:
    # The engine sources without the bundle's _vendor folder, run with no site-packages: no pynvml anywhere.
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1])\n"
        "from engine.host.capabilities import probe_nvml\n"
        "print(json.dumps(probe_nvml()))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-S", "-c", probe, str(root)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert not result["ok"] and "not in the agent bundle" in result["detail"]
    assert "agent bundle is incomplete" in result["fix"] and "driver" not in result["fix"]
