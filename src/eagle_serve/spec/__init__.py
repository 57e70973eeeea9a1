"""Speculation: the draft policy, one drafting round's proposals (head and lookups), the
model-free lookup sources, measured costs, and verification."""
