"""What a training step holds, and would hold: device facts and limits (:mod:`.device`), the tensor
ledger that counts live storages and enforces a limit (:mod:`.ledger`), peak memory against the
micro-batch (:mod:`.curve`), the memory model in sequence length (:mod:`.shapes`), and activation
checkpointing (:mod:`.checkpointing`).

May use: the base modules (``autotune.errors``, ``units``, ``checks``, ``batches``, ``step``, ``rng``).
"""
