"""Every tuning constant of localspec, each with the reason for its value.

A constant here is a choice, not a fact of an API: a value someone picked, and would
change after measuring. Grouped by who reads it.
"""

from __future__ import annotations

# --- how many tokens a round drafts ----------------------------------------------------
DRAFT_MAX = 16  # --draft-max for a fixed drafter: llama.cpp's default
AUTO_DRAFT_MAX = 32  # --draft-max for auto: it picks k itself, and long copies pay up to here
DRAFT_P_MIN = 0.75  # the draft model stops below this top probability: llama.cpp's p_min
ADAPTIVE_K_START = 8  # adaptive k's first round: a miss costs little, two hits reach 32

# --- the backend ----------------------------------------------------------------------
N_BATCH = 512  # most tokens one llama_decode takes (llama.cpp's default -b and -ub)
ALL_LAYERS = 999  # -ngl for "every layer": llama.cpp's idiom, more than any model has

# --- the server -----------------------------------------------------------------------
PREFILL_RESERVE = 64  # batch tokens a step keeps for prompts being prefilled beside drafts
