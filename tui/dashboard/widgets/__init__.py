"""The dashboard's panes."""
