"""Agent commands that start, wait for, stop and inspect supervised runs (engine/supervisor)."""

from __future__ import annotations
