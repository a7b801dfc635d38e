"""OpenAI's API surface: the Chat Completions and Completions wire shapes (`wire_format`, `chat_format`,
`sse_events`, `logprob_shapes`), the Responses API (`responses_api`, `responses_format`), embeddings, and
vLLM's `/tokenize` and `/detokenize`.

The engine's chat and completion requests (`server.requests`) are parsed from OpenAI's bodies, so the
other surfaces translate their requests into those bodies first.
"""
