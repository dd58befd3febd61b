"""``autotune report`` and friends: ``main(argv) -> int`` (:mod:`.main`) and the built-in demo model
(:mod:`.demo`).

May use: every wing below.
"""

from autotune.cli.main import main

__all__ = ["main"]
