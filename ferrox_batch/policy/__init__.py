"""Per-row text policies: stop matching and UTF-8 streaming."""
