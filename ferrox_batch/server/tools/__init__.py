"""Tool calling on the chat endpoint: what a request offers (`definitions`), the formats calls are written
in (`hermes` where the chat template renders tools, `generic` where it does not), and how calls stream
(`call_scanner`, `stream`)."""
