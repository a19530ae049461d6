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
FIRST_TOKEN_SHARE = 0.5  # while a prompt prefills, drafts beside it add at most this to the step's time
BATCH_GAIN = 0.1  # above serve's limit, a draft must lift its step's tokens per time this much ...
QUIET_MAX = 16  # ... and a sequence whose drafts it did not pay for drafts again within this many steps
TRIALS, TRIAL_GAIN = 2, 0.3  # ... a pass size never timed is tried this often beside a plain pass, to
# time it, where its hope lifts the step's rate this much
KEPT_PRIOR, KEPT_DECAY = 16.0, 0.97  # ... and promises scaled by what kept drafts gave (tokens, decay per draft)
PREFILL_RESERVE = 64  # batch tokens a step keeps for prompts being prefilled beside drafts
PROMPT_CACHE_MIB = 8192  # serve --cache-ram: llama-server's default size of its prompt cache
SLOT_COPY_MIN = 32  # prompt tokens another slot must hold beyond the chosen slot's for its
# cells to be copied over: a copy moves the slot's whole KV stream, ~2.5 prefill tokens'
# time for SmolLM2-135M on 2 EPYC cores (less for larger models), so 32 leaves a margin

# --- auto: the policy (core/drafters/auto.py) ----------------------------------------
ACCEPT_DECAY = 0.98  # per observation: old traffic fades, recent traffic decides
ACCEPT_SMOOTH = 2.0  # pseudo-counts pulling a_i toward a_{i-1}
EXPLORE_EVERY = 64  # rounds between probes of a draft model the policy has written off
EXPLORE_MIN = 4  # ... at least, while probes keep coming back fully accepted (each one
# halves the wait, a miss doubles it): evidence that it pays arrives in tens of rounds
MARGIN = 0.05  # expected gain over plain decoding below which auto does not draft
MIN_EXTRA = 0.1  # ... nor below this many expected extra tokens a round: on a flat (GPU)
# curve a 1-in-20 guess "pays" 5% by estimate, within the noise of both estimates
OPTIMISTIC = 0.9  # acceptance a model draft reaches at best on easy text
BUDGET = 0.015  # share of plain decoding's time auto may lose to it trying unmeasured sizes
BUDGET_FREE = 1.0  # ... plus this many one-token times
TRY_BUDGET = 0.03  # share it may lose against the best measured choice doing so
MODEL_REACH = 4  # the longest draft-model plan before any run was accepted (then 2x the longest)
MODEL_K_MAX = 32  # the draft model stops where it is unsure long before this
MODEL_REACH_GROWTH = 2  # ... a plan reaches this x the longest run accepted so far
MODEL_PRIOR = 0.6  # a draft model's acceptance before any evidence: most pairs reach it on code
PROBE_K = 2  # tokens a probe drafts: enough to learn from, little to lose

# --- auto: what verifying costs (core/drafters/costs.py) ------------------------------
WINDOW = 15  # recent verify times kept per batch size (their median is the estimate)
MIN_SEEN = 1  # verify times at a batch size before it counts as measured (one is within
# a shared machine's noise, which the JAG allowance above a measured size covers)
STEADY = 3  # ... before it is the one-token time everything is relative to, or rescales
# the sizes around it
DIP = 0.05  # a measured size between GRID's this far below their chord is a cheap point
REBUILD_MOVE = 0.01  # a median moving less than this share leaves the tables as they are
DRAFT_TIME_WEIGHT = 0.2  # weight of the newest per-token draft time in its running mean
C_GUESS = 0.5  # draft/target per-token cost ratio before anything measured it
JAG = 1.3  # per-token cost at an unmeasured size: at worst this x the nearest measured below
# verify sizes auto drafts for: dense where CPU kernels switch, sparser where V is smooth
GRID = (*range(1, 11), 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
        160, 192, 224, 256, 320, 384, 448, 512)

# --- auto: how long copied runs last (core/drafters/copy_age.py) --------------------------
# first age of each bin, and the prior acceptance there: a little below what the built-in
# workloads measure in hindsight (docs/measurements.md), since a low prior costs a few
# plain rounds before the evidence lifts it and a high one costs failed verifies
EDGES = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385)
PRIOR = (0.2, 0.35, 0.5, 0.6, 0.75, 0.85, 0.9, 0.93, 0.95, 0.96, 0.97, 0.97, 0.98,
         0.985, 0.99, 0.99, 0.995, 0.995)
# ... where the generation is expected to copy a given text (an edit's file, a request's
# `prediction`): a little below what the built-in edits measure in hindsight. A copy
# breaks where the edit changes something, and otherwise holds from its first tokens on
COPY_PRIOR = (0.5, 0.6, 0.65, 0.8, 0.85, 0.9, 0.93, 0.94, 0.95, 0.96, 0.96, 0.97, 0.98,
              0.985, 0.99, 0.99, 0.995, 0.995)
# ... where that text is a prediction of the output (an edit's foretold changes made:
# renames.py): such a copy breaks only where the model does more or other than the
# instruction says, or cuts the same text into other tokens. Measured on the model's own
# outputs of the edit corpus, the held-out and the built-in edits (`scripts/replay_policy.py
# hazard`: every position's next token), a token breaks it 0 of 50 times at ages 3-8, 0 of
# 159 at 9-24, 0.2% at 25-128, 0.3% beyond (a copy of the file: 4.5%, 3%, 0.9%, 0.7%; of
# the output's own earlier text, drafted at PRIOR: 38%, 23%); the prior is a little below that:
# half COPY_PRIOR's hazard up to 8 (few runs there), then 0.5-1.5% up to 64 and 0.25-0.5%
# beyond
PREDICTED_PRIOR = (0.75, 0.8, 0.825, 0.9, 0.925, 0.95, 0.975, 0.98, 0.985, 0.99, 0.99, 0.99,
                   0.995, 0.995, 0.995, 0.995, 0.9975, 0.9975)
AGE_CAP = 1024  # ages beyond this fall in the last bin
OPEN_BIN_WIDTH = 64  # the last bin is open: its prior weighs as if it were this wide
RUN_DECAY = 0.97  # per run reaching a bin: the last few dozen runs at each age decide
RUN_SMOOTH = 2.0  # pseudo-runs at the prior's acceptance in each bin

# --- n-gram drafting while copying a text (core/drafters/ngram.py) --------------------
SURE = 2  # a source token the output replaced is drafted replaced (or kept) once its last
# this many tokens there were so: once is no rule (a class renamed in code, its name kept
# in a docstring), and the last ones decide, not a count over the whole output (a name
# renamed in one function, kept in the next); till then a draft stops before it and the
# target decides. A change longer than one for one (a rule: what the output wrote in
# place of which source tokens, between which two) is drafted once made this many times
# more often than the source was kept there
REWRITE_SPAN = 16  # source tokens a change may replace, and (plus 2) output tokens it may
# take, to be learned as a rule: a type hint, a field added to a line; a longer change is
# no rule that repeats, and the n-gram lookup finds the copy again behind it
BREAK_SPAN = 32  # output tokens: a copy left again within them goes on as old as its last stretch
PARK_MIN_RUN = 16  # a copy left after holding this long is taken up again where the output
PARK_SPAN = 256  # returns to it within this many output tokens (an inserted docstring);
# the recorded edits replay the same with 8 or 32, and with 64 or 1024

# --- auto: the memory of earlier outputs (core/drafters/memory.py) --------------------
MEMORY_MAX_TOKENS = 1 << 20  # a memory's default bound (texts and separators)
MEMORY_KEEP = 0.75  # share of the bound kept when the oldest texts are dropped (drops are rare)
MEMORY_MIN_SHARE = 0.3  # a continuation fewer of the followed occurrences agree on ends the draft
MEMORY_PROMPT_MAX = 8192  # tokens of a prompt remembered beside its output (its end)
MEMORY_RECENT_PROMPTS = 8  # earlier prompts a new one is compared with: their shared start is not stored again

MEMORY_LEN_EDGES = (2, 4, 8, 16, 32, 64)  # match length (the matched n-gram plus the draft so far)
MEMORY_COUNT_EDGES = (1, 2, 3, 5, 9)  # occurrences that continued with the drafted token
# prior acceptance by match length, and the share of its misses left at each count: a
# little below what a repeating session shows, since evidence lifts a low prior in a few
# rounds while a high one costs failed verifies
MEMORY_PRIOR_LEN = (0.25, 0.4, 0.55, 0.7, 0.8, 0.9)
MEMORY_PRIOR_MISS = (1.0, 0.85, 0.7, 0.55, 0.45)
# a young match that takes up the text a copy broke off from (memory.py's re-entry): at
# most this many tokens on from the break, on both sides; weighed apart below this age
MEMORY_REENTRY_SKIP = 12
MEMORY_REENTRY_YOUNG = 8
MEMORY_REENTRY_BREAKS = 4  # latest breaks a re-entry may take up (a short wrong candidate breaks too)
MEMORY_REENTRY_PRIOR = 0.6  # its prior, as MEMORY_PRIOR_LEN's
MEMORY_DECAY = 0.97  # per candidate reaching a bin: the last few dozen decide
MEMORY_SMOOTH = 2.0  # pseudo-tokens of the prior in each bin
