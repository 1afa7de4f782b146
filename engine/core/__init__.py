"""The engine's torch-free core: requests, the scheduler and the paged KV bookkeeping.

Everything here is plain Python and decides *what* runs each step; `engine.worker` decides
*how*. The scheduler hands the worker a `step_io.SchedulerOutput` and gets a `RunnerOutput`
back; nothing in this package imports torch or anything above it (checked by
`tests/test_import_graph.py`). Below it sit only `engine.config`, `engine.errors` and
`engine.sampling_params`, which import nothing of the engine but `engine.errors`.
"""
