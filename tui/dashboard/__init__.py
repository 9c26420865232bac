"""The Textual dashboard (``specdec-tui connect``): one screen of the run, live, and the keys that act on it.

- ``app`` (with ``app.tcss``): the app; folds the session's events into ``DashboardState`` and draws what
  changed once per flush; ``messages`` is the one message it posts itself (the link's state); ``nodes_app``
  the same for one run over several machines; ``plain``: every notice of both is plain text.
- ``state``: ``DashboardState``, what the dashboard knows, and ``Dirty``, the named keys of what changed since the
  last draw; ``panes``: every pane declared once (its ``Dirty`` key, CSS id, title, the widget made from the state
  and how it redraws), which both screens compose and draw.
- ``controls``: what each key does, owned by ``RunControl`` (commands to the host) or ``ViewControl`` (this
  screen only); ``keys`` is the key table; ``attach`` plans handing the terminal to the run's tmux.
- ``theming`` and ``live_reload``: colour themes and the watcher that reloads themes and profiles.
- ``screens/``: the dashboard screen, the nodes screen and the modals; ``widgets/``: each pane's model and widget.

To add a pane:

1. ``widgets/<name>.py``: its model (what it keeps of the events) and its widget (taking an ``id``).
2. ``state.py``: a ``Dirty`` key, and the model as a ``DashboardState`` field that ``ingest`` feeds, adding the key
   when it changes (the nodes screen gets each node's keys from there).
3. ``panes.py``: one declaration, ``NAME = Pane(Dirty.NAME, "name", "title", Widget, make, draw)``.
4. ``screens/dashboard.py``: ``yield panes.NAME.compose(state)`` where it sits in ``compose``, and ``panes.NAME`` in
   ``PANES`` (the draw order); its size in ``app.tcss`` under ``#name``.
5. ``screens/nodes.py``, if each node shows it: ``yield panes.NAME.compose(node, i)`` in the node's row and
   ``panes.NAME`` in ``NODE_PANES``; its size in ``NodesScreen.DEFAULT_CSS``.

``tests/tui/test_panes.py`` fails while a declared pane or ``Dirty`` key is missing from the dashboard screen.

It sees the host through ``tui.link`` and composes launches with ``tui.relaunch``; never the CLI.
"""
