"""`localspec chat`: a terminal chat UI (textual) or a line REPL, over the engine."""
