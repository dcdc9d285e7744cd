"""The audit trail: `store` (SQLite, WAL, retention), `verify` (re-checks a recorded request
against the target: the proof behind `speclanes audit verify`), `cli` (`speclanes audit ...`)."""
