"""Speculative decoding in the torch-free core: what to propose, how many, what came back.

The scheduler asks a `Speculator` each step how many tokens a decoding request proposes
(the adaptive rule, adaptive.py) and which: the id-only proposers run here (ngram.py,
suffix.py); a worker-side proposer's ids (a draft model, the grammar's forced tokens)
arrive in `RunnerOutput.draft_token_ids` and are kept on the request until its next step.
"""
