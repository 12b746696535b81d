"""bwrap's fork server: ``client`` is this process's side (``fork_server``, ``preload``, a run's
request and its end), ``server.py`` the program that runs inside the bwrap sandbox (as
``python3 -I -S -c SOURCE``, stdlib only, never imported by the host)."""
