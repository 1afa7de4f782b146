"""Embeddings: what the checkpoint declares (`spec`) and the pooled vectors (`pooler`).

An embedding model runs its prompts through the same decoder as a generation model and
never samples: the runner hands the final hidden states of each prefill chunk to the
`Pooler`, which keeps per-request partial results across chunks and answers with one plain
vector per request whose prompt is done.
"""
