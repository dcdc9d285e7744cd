"""The protocol between processes and with clients.

- `messages`: every message on every socket (msgspec structs, one tagged union per socket);
- `transport`: nng sockets under trio;
- `config`: the TOML configuration, environment and --set overrides;
- `client`: the Python clients, blocking and trio (submit, resumable chunk stream, status).
- `feed`: the trio client's one long poll (`Watch`) for the chunks of all its streams.
A new message or fault kind goes in `messages` (and in the union of the socket that carries it).
"""
