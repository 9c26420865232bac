"""The dashboard's screens: the main dashboard and its modals."""
