"""``python -m autotune report ...``: the same as the ``autotune`` command."""

from autotune.cli.main import main

raise SystemExit(main())
