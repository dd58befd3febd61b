"""Training exactly at the planned batch: ``fit`` and its loop (:mod:`.fit`), a window of micro-batches
per mode (:mod:`.sharded` for FSDP2), ``accumulate`` for your own loop (:mod:`.accumulate`), BatchNorm
under accumulation (:mod:`.bn`), the gradient noise scale (:mod:`.noise`) and Optuna BatchNorm
tuning (:mod:`.tune`).

May use: every wing below (base, memory, parallel, probe, planning).
"""
