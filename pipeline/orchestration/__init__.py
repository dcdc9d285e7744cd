"""The orchestrator's core, with no I/O and no clock of its own (lanes/orchestrator.py is the
process around it):

- `hub`: `Hub` routes everything and returns the messages to send;
- `request`: `RequestMachine`, one request's step protocol (drafts, verify, re-prime, finish);
- `lane_table`, `audit_outbox`, `front` (the requests clients poll, resume, cancel),
  `admission` (Submit -> admitted or refused), `tracing` (traces and metrics);
- `effects`: what the parts ask of the world.
A new fault kind's handling goes in `request` (per request) or `hub` (per lane).
"""
