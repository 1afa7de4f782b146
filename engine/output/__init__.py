"""From sampled token ids to what callers read: tokenizer, incremental detokenizer, stop
strings, and the `RequestOutput`s (`request_output`) the output processor builds per step."""
