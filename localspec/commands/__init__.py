"""The CLI commands, one module per command and named after it (`localspec run` is
run.py), each a thin layer that parses options and calls the library. options.py holds
the click options they share (llama.cpp spellings) and their config dataclasses;
ui.py and progress.py the terminal rendering they share."""
