"""``--dist-adopt``: distributed tests written for torch's own harness, run on warm pools.

Reading order: :mod:`._torch_test_harness` (the one audited module that knows torch's
private test-harness protocol), :mod:`.rank` (what each rank runs for one test method, and
how the class's own ``init_process_group`` / ``destroy_process_group`` are served from the
pool's group), :mod:`.plugin` (the pytest side: collection, items, the pool each runs on).
Imports run that way; the plugin is registered by :mod:`distconform.harness.adopt.options` only when
asked.
"""
