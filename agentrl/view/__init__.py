"""`agentrl view`: a run folder in the browser (index.py: the trajectory files' cached line
index; folder.py: what the page asks of a run; server.py: HTTP on 127.0.0.1; export.py:
the static copy; static/: the page, its script and styles, the vendored chart library)."""
