"""Anthropic's Messages API on the same engine and the same admission as the OpenAI endpoints.

One concept per module: `request` rewrites a Messages request into the chat request it amounts to (so
the chat parser checks it, and both endpoints accept and refuse alike), its `messages` and its `options`
(tools, thinking, output format) each read by a module of their own; `answer` writes the engine's
answer back as a Message, whole or as Anthropic's stream of events; `errors` is Anthropic's error
shape; `count_tokens` counts a request's templated prompt without generating. Nothing is imported
here, so that the layers below (`preparation`) can import `request` and `answer` without a cycle.
"""
