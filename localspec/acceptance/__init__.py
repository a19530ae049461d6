"""The acceptance log: every generation's acceptance and speed, in SQLite.

    logdb.py      schema with numbered migrations, WAL, writes that never break a run
    classify.py   workload tags (code, json, edit, prose) for untagged generations
    drift.py      acceptance drift alerts for `localspec stats`
"""
