"""Colour themes shipped with specdec-tui (TOML files, loaded by tui.dashboard.theming)."""
