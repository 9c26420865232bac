"""The Textual dashboard (``specdec-tui connect``): one screen of the run, live, and the keys that act on it.

- ``app`` (with ``app.tcss``): the app; folds the session's events into ``DashboardState`` and draws what
  changed once per flush; ``messages`` is the one message it posts itself (the link's state); ``nodes_app``
  the same for one run over several machines; ``plain``: every notice of both is plain text.
- ``controls``: what each key does, owned by ``RunControl`` (commands to the host) or ``ViewControl`` (this
  screen only); ``keys`` is the key table; ``attach`` plans handing the terminal to the run's tmux.
- ``theming`` and ``live_reload``: colour themes and the watcher that reloads themes and profiles.
- ``screens/``: the dashboard screen and its modals; ``widgets/``: its panes.

It sees the host through ``tui.link`` and composes launches with ``tui.relaunch``; never the CLI.
"""
