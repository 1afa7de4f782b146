"""Multi-LoRA: PEFT adapters applied per request, batched across adapters in one step.

    peft_adapter.py  read and check a PEFT directory -> LoRAWeights (CPU, scale folded in)
    registry.py      the adapters loaded in host memory, by name (thread-safe; removals)
    model_lora.py    the runner's side: wrapped linears, device slots, each step's batch
    layers.py        LoRALinear: base product + the batched LoRA delta per fused slice
    batch.py         LoRABatch: the step's rows grouped by adapter slot
    slots.py         SlotTable: adapters in the `lora.max_loras` device slots, LRU

See docs/adapters.md.
"""
