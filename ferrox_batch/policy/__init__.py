"""Per-row text policies: stop matching, UTF-8 streaming, sliding-window arithmetic."""
