"""``python -m ringserve serve ...``: the ``ringserve`` command."""

from ringserve.server.cli import main

raise SystemExit(main())
