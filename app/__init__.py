"""The HTTP/WebSocket server over the engine's scheduler (see docs/PROTOCOL.md)."""
