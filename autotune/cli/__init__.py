"""The command line: ``main(argv) -> int`` and its commands (:mod:`.main`), the parser and what its
arguments name (:mod:`.parser`), the workload a report plans (:mod:`.workload`), the plot and the
messages beside the report's text (:mod:`.render`), and the built-in demo model (:mod:`.demo`).

May use: every wing below.
"""

from autotune.cli.main import main

__all__ = ["main"]
