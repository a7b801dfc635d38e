"""The HTTP layer every API the server speaks shares: access checks, bodies, listening, streaming, metrics.

Nothing here knows an API's request or answer shapes: an API surface (`server.openai`, and the others
beside it) brings those, and its own error shape (`error_shapes`), and these modules carry them.
"""
