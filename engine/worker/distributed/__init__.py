"""Tensor parallelism across processes: rank 0 is the engine's own process, ranks 1.. are
worker processes it starts (multiprocessing, spawn), joined by torch.distributed (gloo on
the CPU, NCCL on CUDA: the backend is the only difference between the two).

    checks.py     what a tensor-parallel config must satisfy, refused at start (ConfigError)
    group.py      joining the process group; each rank's device and CPU threads
    transport.py  each step's SchedulerOutput (plus the tokens rank 0 sampled last step),
                  encoded once and put in every worker's shared-memory ring
    worker.py     a worker process: load its shard, size its KV cache, run the steps it is
                  sent, exit with rank 0
    pool.py       rank 0's side: start the workers, send each step, watch them, turn a
                  death or a hang into one clear fatal error, stop them

What each rank computes (the sharded model) lives in `engine.worker.models.parallel`.
"""
