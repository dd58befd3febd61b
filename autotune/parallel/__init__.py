"""Ranks: the agreements planning makes (:mod:`.ranks`: gathers, wrappers, failures that stop every
rank) and the one gradient exchange per optimizer step of data-parallel training (:mod:`.exchange`).

May use: the base modules and :mod:`autotune.memory`.
"""
