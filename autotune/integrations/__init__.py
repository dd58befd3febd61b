"""autotune inside the trainers people already use.

- :mod:`autotune.integrations.hf`: the Hugging Face ``Trainer`` (``prepare(trainer, target_batch=...)``);
- :mod:`autotune.integrations.lightning`: Lightning (``AutotuneCallback(target_batch=...)``);
- :mod:`autotune.integrations.accelerate`: an Accelerate script (``plan_accumulation(accelerator, ...)``).

Each plans with the trainer's own model, data collator, loss and optimizer, then sets that trainer's
own knobs (per-device batch, gradient accumulation steps, the learning rate when asked) so that
``per-device batch x accumulation steps x world size`` is the target batch, exactly; each says where
the trainer's accumulation is inexact. Each module imports its trainer only when it is used; install
them as extras: ``pip install 'torch-autotune[hf]'``, ``'torch-autotune[lightning]'``,
``'torch-autotune[accelerate]'``.
"""
