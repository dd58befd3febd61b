"""Ranks: the agreements planning makes (:mod:`.ranks`: gathers, wrappers, a rank that went away),
how one rank's failure stops every rank (:mod:`.stops`), the one gradient exchange per optimizer step
of data-parallel training (:mod:`.exchange`), and the agreements that let FSDP2's ranks survive an
out-of-memory error together (:mod:`.lockstep`).

May use: the base modules and :mod:`autotune.memory`.
"""
