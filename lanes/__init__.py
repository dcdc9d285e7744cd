"""Every supervised process, one module each, each a thin loop around a core from `pipeline/`:

- `orchestrator`: the hub, around `pipeline.orchestration.Hub`;
- `verify`: the target model, around `pipeline.workers.Verifier`;
- `draft`: the drafters, around `pipeline.workers.DraftServer`;
- `audit`: the SQLite recorder, around `pipeline.audit.store.AuditStore`;
- `gateway`: the OpenAI-compatible HTTP server, around `pipeline.api.server.Gateway`;
- `lane`: what they all share (lifeline, heartbeats, fault reports, `python -m lanes.<name>`).

The supervisor (`pipeline.service.supervisor`) starts them by module name; nothing in
`pipeline/` imports this package.
"""
