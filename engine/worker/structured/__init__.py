"""Structured outputs on llguidance: compile a constraint at admission, mask per step.

`compiler` turns a `StructuredOutputsParams` into a `CompiledGrammar` (cached, bounded in
time and work; called from `LLMEngine.prepare_request`, never on the engine thread);
`matcher` holds one request's grammar state in the runner; `bitmask` fills and applies the
batch's token bitmask in the sampler. `engine.core` never imports this package: a request
carries its `CompiledGrammar` as an opaque object.
"""

from engine.worker.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.worker.structured.matcher import GrammarState

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarState"]
