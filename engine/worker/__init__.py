"""The worker: runs a scheduled step on the model and samples from it.

`runner.ModelRunner` owns the model, the paged KV tensors and per-request input state;
`input_batch` turns a `SchedulerOutput` into tensors, `sampler` picks tokens, `attention/`
holds the paged attention backends, `models/` the architectures and their loader,
`kernels/` the native CPU kernels, `kv_sizing` how many KV blocks fit. It depends on
`engine.core` for the step dataclasses and never on the scheduler itself.
"""
