"""``python -m autotune.cli report ...``: the same as the ``autotune`` command."""

from autotune.cli.main import main

raise SystemExit(main())
