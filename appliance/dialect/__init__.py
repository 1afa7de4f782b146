"""The OpenAI dialect shared by HTTP and gRPC: tool-call and reasoning parsers, the prompt
fallback for templates without tools, and the grammar that enforces a required tool call."""
