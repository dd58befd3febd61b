"""The plan and everything about it: the :class:`~autotune.planning.plans.Plan` (pure), the scaling
rules for the learning rate and BatchNorm (:mod:`.scaling`, pure), the report and framework configs
(:mod:`.report`, pure), the plan cache (:mod:`.cache`), and the verbs that make plans: the planner
(:mod:`.planner`, ``autotune.plan``), what-if tables (:mod:`.whatif`) and shard plans (:mod:`.sharding`).

May use: the base modules, :mod:`autotune.memory`, :mod:`autotune.parallel`, :mod:`autotune.probe.largest`.
"""
