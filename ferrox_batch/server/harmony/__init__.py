"""gpt-oss's chat format (harmony): `reading` reads an answer's channels and calls from its text with the
special tokens kept, `choice` says when a server speaks it and how its parts become every API's pieces."""
