"""Speculative decoding in the worker: verify a step's proposals, propose with tensors.

`verify.py` turns the logits of a request's 1 + k verified positions into its accepted
tokens (greedy and the id-only proposers: accept while each position's own sample equals
the proposal; a draft model's sampled proposals: the rejection rule of `rejection.py`);
`grammar.py` gives each verified position its grammar mask and proposes a grammar's forced
tokens; `proposer.py` is the interface of a proposer that runs here after the verify step
(`draft_model.py`: a smaller model with its own paged KV; EAGLE/MTP heads would fit it).
"""
