"""Our own model code (Llama/Mistral/Qwen2/Qwen3), the registry and the checkpoint loader.

Import what you need from the submodules: `engine.worker.models.registry`, `engine.worker.models.loader`.
"""
