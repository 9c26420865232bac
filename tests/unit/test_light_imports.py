"""What the light entry points load: a config error of ``specdec-train`` is said before torch or transformers are
imported, and the agent (stdlib only, shipped to hosts without them) imports neither, nor the client's textual.
Pinned by what is in ``sys.modules`` when the process exits, not by how long it took."""

from __future__ import annotations

from support.imports import HEAVY, imported_by, specdec_train


def test_a_config_error_exits_2_with_neither_torch_nor_transformers_loaded() -> None:
    done = imported_by(specdec_train("--set", "bad=1"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("specdec-train: config error: bad: unknown key"), done.stderr
    assert done.loaded == [], f"loaded before the config error: {done.loaded}"


def test_the_probe_sees_torch_once_it_is_imported() -> None:
    """The check above can fail: a process that imports torch is seen doing so."""
    done = imported_by("import torch.nn\n")
    assert done.returncode == 0 and done.loaded == ["torch"], done.stderr


def test_importing_the_agent_loads_neither_torch_transformers_nor_textual() -> None:
    done = imported_by("import engine.agent.main\n", watched=(*HEAVY, "textual"))
    assert done.returncode == 0, done.stderr
    assert done.loaded == [], f"the agent imported {done.loaded}"
