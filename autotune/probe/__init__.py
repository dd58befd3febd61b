"""Trials that change nothing: a real training step at one micro-batch, run and undone (:mod:`.trial`,
with the snapshot that restores the model, optimizer, RNGs and loader), the same step traced on fake
tensors (:mod:`.estimate`, the estimates: trials without data), the pure search for the largest size
that fits (:mod:`.search`) and the probe that runs it with estimates and real trials (:mod:`.largest`).

May use: the base modules, :mod:`autotune.memory`, :mod:`autotune.parallel`.
"""
