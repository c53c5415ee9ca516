"""One forward: its plan (built once, before the forward) and its captured graphs."""
